"""`activation_dtype="q8"` through the engine on a Q4_K_M file llama.cpp's own tools wrote (Q4_K, Q6_K
and Q8_0 blocks): every block linear of the model, fused groups of mixed types too, gives what the
plain integer arithmetic (`kernels.ggml_q8`) gives on its input, the logits stay near the exact mode's
on the same weights, and the integer kernels run in the prefill and in the compiled decode steps."""

import pytest
import torch

from kvstate.kernels import activation, fused, linear_module
from kvstate.kernels.ggml_q8 import linear_q8
from kvstate.models.generate import forward_logits
from tests.kernels.conftest import extension


@pytest.fixture
def q4_k_m(converted, tmp_path):
    from kvstate.bench.llama_cpp import quantize
    from tests.gguf.conftest import LLAMA_QUANTIZE

    if not LLAMA_QUANTIZE.is_file():
        pytest.skip(f"no llama-quantize at {LLAMA_QUANTIZE}")
    return quantize(LLAMA_QUANTIZE, converted["bf16"], "q4_k_m", tmp_path / "q4_k_m.gguf", threads=1)


def test_q8_mode_on_a_q4_k_m_file(q4_k_m, monkeypatch):
    from kvstate import LLM, SamplingParams

    ext = extension()

    def check(x, y, raws, qtypes, bias=None):  # a call against the reference on the same input
        x2 = x.reshape(-1, x.shape[-1]).float().numpy()
        ref = torch.cat([torch.from_numpy(linear_q8(x2, raw, q)) for raw, q in zip(raws, qtypes)], -1)
        ref += 0 if bias is None else bias.double()
        assert float((y.reshape(ref.shape).double() - ref).norm() / ref.norm()) <= 1e-5, qtypes
        calls.append(qtypes)
        return y

    calls = []
    block_linear, parts_linear = linear_module.block_linear, fused.block_parts_linear
    try:
        llm = LLM(q4_k_m, activation_dtype="q8", cache_memory="16MiB")
        assert activation.activation_dtype() == "q8"
        ids = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2]]
        before = sum(ext.quant_q8_calls())
        with torch.no_grad():
            ours = forward_logits(llm.model, ids)[0].double()
            prefill = sum(ext.quant_q8_calls()) - before
            with monkeypatch.context() as patch:
                patch.setattr(linear_module, "block_linear",
                              lambda x, raw, b, q: check(x, block_linear(x, raw, b, q), [raw], (q,), b))
                patch.setattr(fused, "block_linear",
                              lambda x, raw, b, q: check(x, block_linear(x, raw, b, q), [raw], (q,), b))
                patch.setattr(fused, "block_parts_linear",
                              lambda x, raws, qs: check(x, parts_linear(x, raws, qs), raws, qs))
                forward_logits(llm.model, ids)
            activation.set_activation_dtype("fp32")
            exact = forward_logits(llm.model, ids)[0].double()
        assert {"Q4_K", "Q6_K", "Q8_0"} <= {q for qs in calls for q in qs} and prefill == len(calls)
        assert any(len(set(qs)) > 1 for qs in calls)  # a fused group of mixed types (quant_linear_parts)
        # each linear moves ~0.7% (tests/kernels); this tiny random model compounds it to ~10%
        rel = float((ours - exact).norm() / exact.norm())
        assert 0.001 < rel < 0.2, rel
        activation.set_activation_dtype("q8")
        before = sum(ext.quant_q8_calls())
        out = llm.generate([ids[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and sum(ext.quant_q8_calls()) - before >= 4 * prefill
    finally:
        activation.set_activation_dtype("fp32")
