"""Speculative decoding with the checkpoints' own MTP heads (kvstate.engine.speculative.mtp).

Tiny Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints get random `mtp.*` tensors under the real
checkpoints' names (tests/models/mtp_checkpoint.py). The drafts are checked against a reference
built from transformers' own pieces, the math of docs/mtp.md as vLLM's qwen3_next_mtp.py writes it
(not from kvstate's code): the target's normed last hidden state h_p, fc over
[pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)], the checkpoint's full-attention
decoder layer (transformers' class) at rotary position p, the final norm, the shared LM head; draft
i > 1 on the head's own output. The reference recomputes the head over the whole sequence from
scratch at every step, so a draft that read KV a rejected draft left behind differs from it.
"""

import copy

import pytest
import torch
from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3NextConfig, Qwen3NextForCausalLM)

from kvstate import LLM, SamplingParams
from kvstate.cache.spec import cache_spec
from kvstate.engine.speculative.drafter import Drafter
from kvstate.errors import KvstateError
from kvstate.families import read_plan
from kvstate.models import decode_blocks
from tests.greedy import greedy_generate
from tests.arrivals import run_arrivals
from tests.models.checks import random_ids, redraw_weights
from tests.models.mtp_checkpoint import TINY_QWEN3_5, add_mtp

VOCAB = 101
NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=48, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=48, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            layer_types=["linear_attention", "full_attention"] * 2)
MOE = dict(TINY_QWEN3_5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
FAMILIES = {
    "qwen3_5": lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_QWEN3_5, intermediate_size=96)),
    "qwen3_5_moe": lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE)),
    "qwen3_next": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(**NEXT)),
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def save_mtp_checkpoint(name: str, path):
    """A tiny `name` checkpoint with random mtp.* tensors saved at `path`: (transformers model, the mtp tensors)."""
    torch.manual_seed(0)
    hf = FAMILIES[name]().eval()
    redraw_weights(hf, 0)
    hf.save_pretrained(path)
    return hf, add_mtp(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, checkpoint path with mtp.*, the mtp tensors)."""
    path = tmp_path_factory.mktemp(request.param)
    hf, mtp = save_mtp_checkpoint(request.param, path)
    return request.param, hf, path, mtp


def mtp_llm(path, k, **kw):
    kw = {"cache_memory": "16MiB", "block_size": 4, "max_num_seqs": 4, **kw}
    return LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)


def fused_experts(sd: dict, layer) -> dict:
    """Per-expert tensors as saved (experts.E.{gate,up,down}_proj.weight) -> the module's stacked parameters."""
    want = layer.state_dict()
    if "mlp.experts.gate_up_proj" not in want or "mlp.experts.gate_up_proj" in sd:
        return sd
    n = want["mlp.experts.gate_up_proj"].shape[0]
    e = [[sd.pop(f"mlp.experts.{i}.{w}_proj.weight") for w in ("gate", "up", "down")] for i in range(n)]
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in e])
    sd["mlp.experts.down_proj"] = torch.stack([d for *_, d in e])
    assert sd["mlp.experts.gate_up_proj"].shape == want["mlp.experts.gate_up_proj"].shape
    return sd


class Reference:
    """The MTP head of docs/mtp.md from transformers' modules (the decoder layer class of the checkpoint's
    full-attention layer 1, its rotary, its RMSNorm class) and the saved mtp.* tensors."""

    def __init__(self, hf, mtp: dict):
        self.hf = hf
        self.layer = copy.deepcopy(hf.model.layers[1])  # a full-attention layer of the same class and config
        self.layer.load_state_dict(fused_experts({k[len("mtp.layers.0."):]: v for k, v in mtp.items()
                                                  if k.startswith("mtp.layers.0.")}, self.layer))
        norm = type(hf.model.norm)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = copy.deepcopy(hf.model.norm)
            self.norms[name].weight.data.copy_(mtp[f"mtp.{name}.weight"])
            assert isinstance(self.norms[name], norm)
        self.fc = mtp["mtp.fc.weight"]

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after `tokens` (x_0 .. x_{n-1}), recomputed from scratch."""
        ids = torch.tensor([tokens])
        h = self.hf.model(ids).last_hidden_state[0, :-1]  # h_0 .. h_{n-2}, after the final norm
        nxt, out = list(tokens[1:]), []  # the token after each position
        for _ in range(k):
            e = self.norms["pre_fc_norm_embedding"](self.hf.model.embed_tokens(torch.tensor([nxt])))
            x = torch.cat([e, self.norms["pre_fc_norm_hidden"](h[None])], dim=-1) @ self.fc.T
            pos = torch.arange(len(nxt))[None]
            y = self.layer(x, position_embeddings=self.hf.model.rotary_emb(x, pos), attention_mask=None,
                           position_ids=pos)
            y = self.norms["norm"](y[0] if isinstance(y, tuple) else y)[0]  # [T, H]
            out.append(int(self.hf.lm_head(y[-1]).argmax()))
            nxt.append(out[-1])
            h = torch.cat([h, y[-1:]])  # the next step reads the head's own output at the new position
        return out


def test_checkpoint_with_mtp_loads_and_plans_its_kv(family):
    name, hf, path, mtp = family
    plan = read_plan(path)
    assert len(plan.mtp) == 1 and plan.mtp[0].index == plan.num_layers
    assert plan.mtp[0].ffn.kind == ("mlp" if name == "qwen3_5" else "moe")
    cfg = hf.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # one more attention layer's fp32 K and V
    plain, with_mtp = (cache_spec(plan, kv_dtype="float32", mtp=m) for m in (False, True))
    assert with_mtp.kv_bytes_per_token - plain.kv_bytes_per_token == per_token
    assert with_mtp.state_bytes == plain.state_bytes
    llm = mtp_llm(path, 1)
    assert llm.model.mtp is not None
    assert llm.engine.runner.cache_spec == with_mtp  # the pools are the planner's, MTP block included
    assert llm.engine.runner.caches[-1].k.shape[2:] == (cfg.num_key_value_heads, cfg.head_dim)


def test_checkpoint_without_mtp_refuses_method_mtp(tmp_path):
    torch.manual_seed(0)
    FAMILIES["qwen3_5"]().save_pretrained(tmp_path)
    with pytest.raises(KvstateError, match="method 'mtp' needs a checkpoint with multi-token-prediction") as e:
        mtp_llm(tmp_path, 1)
    assert "\n" not in str(e.value)


class Checked(Drafter):
    """Wraps the MTP drafter: checks its drafts against the reference, then hands the verify the plain
    greedy continuation with every third position wrong, so verify entries accept 0..k drafts and
    the head's KV is rewritten after acceptances of every length."""

    def __init__(self, inner, ref, expected):
        self.inner, self.ref, self.expected, self.checked = inner, ref, expected, 0
        self.after_step, self.release = inner.after_step, inner.release

    wants_hidden = True

    def propose(self, requests):
        out = []
        for (seq, k), drafts in zip(requests, self.inner.propose(requests)):
            tokens = seq.token_ids(0, seq.num_tokens)
            assert drafts == self.ref.drafts(tokens, len(drafts)), len(tokens)
            self.checked += bool(drafts)
            n = seq.num_tokens
            out.append([t if (n + i) % 3 else (t + 1) % VOCAB for i, t in enumerate(self.expected[n:n + len(drafts)])])
        return out


def test_drafts_are_the_reference_heads_and_rejected_kv_is_rewritten(family, monkeypatch):
    """Every step's drafts equal the from-scratch reference, after acceptances and rejections alike;
    the head's one-token steps and chains run as one compiled call each, like the target's decode
    blocks (not MoE's)."""
    name, hf, path, mtp = family
    llm = mtp_llm(path, 3)
    compiled = []
    for fn in ("run_head", "chain_head", "run_chain_head"):
        real = getattr(decode_blocks, fn)
        monkeypatch.setattr(decode_blocks, fn, lambda *a, real=real: compiled.append(True) or real(*a))
    prompt = random_ids(VOCAB, 11, 3)
    expected = prompt + greedy_generate(llm.model, prompt, 12)
    proposer = llm.engine.proposer
    proposer = llm.engine.set_proposer(proposer.config, Checked(proposer.drafter, Reference(hf, mtp), expected))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected[len(prompt):]
    assert proposer.drafter.checked >= 4
    assert 0 < proposer.num_accepted_tokens < proposer.num_draft_tokens
    assert (sum(compiled) >= 4) == (name == "qwen3_5")


def test_greedy_tokens_equal_plain_decoding_alone_batched_prefix_preempted(family):
    name, hf, path, mtp = family
    prompts = [random_ids(VOCAB, n, i) for i, n in enumerate([5, 30, 17, 3, 22, 9])]
    prompts[4] = prompts[1][:16] + prompts[4][16:]  # shares 4 blocks with prompt 1 (prefix caching)
    for k in (2,):
        alone = mtp_llm(path, k)
        expected = [greedy_generate(alone.model, p, GREEDY.max_tokens) for p in prompts]
        assert [alone.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids
                for p in prompts[:2]] == expected[:2]
        batched = mtp_llm(path, k, enable_prefix_caching=True)
        outs = batched.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        again = batched.generate([{"prompt_token_ids": p} for p in prompts[3:]], GREEDY)  # cache hits
        assert [o.outputs[0].token_ids for o in again] == expected[3:]
        assert sum(o.num_cached_tokens for o in again) > 0
        # a pool of 20 blocks of 4 for 6 requests of up to 40 tokens: preemption and recompute
        probe = alone.engine.runner.cache_spec
        tight = mtp_llm(path, k, max_num_batched_tokens=24, max_num_seqs=6,
                        cache_memory=6 * probe.state_bytes + 20 * 4 * probe.kv_bytes_per_token)
        done, _ = run_arrivals(tight.engine, prompts, GREEDY)
        assert [done[i].token_ids for i in range(len(prompts))] == expected
        stats = tight.stats()
        assert stats["kv_blocks_used"] == 0 and stats["spec_num_draft_tokens"] > 0


def test_memory_reports_the_heads_kv(family, capsys):
    import json

    from kvstate.cli import main

    name, hf, path, mtp = family
    assert main(["memory", str(path), "--json", "--kv-dtype", "float32"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["mtp_kv_bytes_per_token"] == 2 * hf.config.num_key_value_heads * hf.config.head_dim * 4
    assert main(["memory", str(path)]) == 0
    assert "MTP block adds" in capsys.readouterr().out


def test_a_bf16_target_runs_its_head_in_bf16_through_the_same_kernels(family):
    """The head's matrices are stored as the target's (bf16 through kvstate's GEMV, fused projections,
    its block compiled where the target's attention blocks are) and greedy output stays exact."""
    from kvstate.kernels import Linear

    name, hf, path, mtp = family
    llm = mtp_llm(path, 2, weight_dtype="bf16")
    head = llm.model.mtp
    linears = [m for m in head.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert head.layers[0].mixer.q_proj.fused_group is not None
    compiled = decode_blocks.plan(head)[0][0] is not None
    assert compiled == (decode_blocks.plan(llm.model)[0][1] is not None)  # as the target's attention block
    prompt = random_ids(VOCAB, 13, 5)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    assert out == greedy_generate(llm.model, prompt, GREEDY.max_tokens)
    assert llm.engine.proposer.num_draft_tokens > 0
