"""`kvstate recall train-mtp`'s trainer: the target stays as it was, the head lands under the real
names, and a run is repeatable (seeded)."""

from dataclasses import replace

from safetensors.torch import load_file

from kvstate.hub import resolve_checkpoint
from kvstate.llm import LLM
from kvstate.recall.train_mtp import STATE, MtpSettings, train_mtp

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


def test_train_mtp_in_chunks_gives_the_head_of_one_run(tmp_path):
    """A run stopped every 2 steps and continued (the state in the output directory) ends on the very
    head one uninterrupted run writes, with a warm-up and a copy-weighted chain; a state left by other
    settings is not continued."""
    src = resolve_checkpoint("kvstate-phonebook-hybrid")
    s = replace(TINY, steps=5, warmup=2, copy_share=0.5, copy_depth_scale=(1.0, 2.0, 3.0))
    train_mtp(src, tmp_path / "one", s, seed=1)
    assert train_mtp(src, tmp_path / "chunks", replace(s, lr=1e-2), seed=1, chunk=2)["done"] is False
    done = [train_mtp(src, tmp_path / "chunks", s, seed=1, chunk=2)["steps"] for _ in range(3)]
    assert done == [2, 4, 5]  # the other lr's state was not continued
    assert not (tmp_path / "chunks" / STATE).exists()
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("one", "chunks"))
    heads = sorted(k for k in a if k.startswith("mtp."))
    assert heads and all((a[k] == b[k]).all() for k in heads)


def test_unrolled_drafts_are_the_heads_chained_drafts():
    """Draft d of the unrolled training forward at row p is what the head drafts at inference: rows 0 .. p
    from the target's states, then d - 1 chained steps on its own y and the true tokens (docs/mtp.md)."""
    import torch

    from kvstate.cache.pools import allocate_pools
    from kvstate.cache.spec import cache_spec
    from kvstate.models.batch import Batch
    from kvstate.models.loader import load_model
    from kvstate.recall.mtp_unroll import unrolled_logits

    model, _ = load_model(resolve_checkpoint("kvstate-phonebook-hybrid"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.plan.vocab_size, (2, 12), generator=g)
    spec = cache_spec(model.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32", mtp=True)
    with torch.no_grad():
        caches = allocate_pools(spec, num_blocks=2, block_size=16, num_slots=2)
        _, hidden = model(ids.flatten(), Batch.build([12, 12], [0, 0], [0, 1], [[0], [1]], 16), caches[:-1],
                          hidden=True)
        unrolled = unrolled_logits(model, hidden.view(2, 12, -1), ids, 3)
        for b, p in ((0, 0), (0, 5), (1, 8)):
            kv = allocate_pools(spec, num_blocks=1, block_size=16, num_slots=1)[-1]
            rows = Batch.build([p + 1], [0], [0], [[0]], 16, logits="all")
            logits, y = model.mtp(ids[b, 1 : p + 2], hidden[12 * b : 12 * b + p + 1], rows, kv, model.embed_tokens,
                                  model.lm_head)
            assert torch.allclose(unrolled[0][b, p], logits[-1], atol=1e-4)
            y = y[-1:]
            for d in (2, 3):
                step = Batch.build([1], [p + d - 1], [0], [[0]], 16)
                logits, y = model.mtp(ids[b, p + d : p + d + 1], y, step, kv, model.embed_tokens, model.lm_head)
                assert torch.allclose(unrolled[d - 1][b, p], logits[0], atol=1e-4)
