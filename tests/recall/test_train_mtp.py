"""`kvstate recall train-mtp`'s trainer: the target stays as it was, the head lands under the real
names, and a run is repeatable (seeded)."""

from safetensors.torch import load_file

from kvstate.hub import resolve_checkpoint
from kvstate.llm import LLM
from kvstate.recall.train_mtp import MtpSettings, train_mtp

TINY = MtpSettings(steps=2, batch=2, copy_words=(4, 8), max_entries=2)


def test_train_mtp_is_seeded_keeps_the_target_and_writes_the_real_names(tmp_path):
    src = resolve_checkpoint("kvstate-phonebook-hybrid")
    for run in ("a", "b"):
        train_mtp(src, tmp_path / run, TINY, seed=3)
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("a", "b"))
    base = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("mtp.")}
    assert all((a[k] == v).all() for k, v in base.items())  # the target is frozen
    heads = sorted(k for k in a if k.startswith("mtp."))
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(heads)
    assert all((a[k] == b[k]).all() for k in heads)  # repeatable
    llm = LLM(str(tmp_path / "a"), speculative_config={"method": "mtp", "num_speculative_tokens": 1},
              cache_memory="16MiB")
    try:
        assert llm.model.mtp is not None
    finally:
        llm.close()
