"""No silent slow path: a CUDA worker refuses a Gated DeltaNet model without the fla kernels."""

from __future__ import annotations

import pytest
import torch

from hsx.errors import BadConfig
from settings import Settings
from workers.target import check_kernels, is_gdn


def test_a_gdn_model_on_cuda_without_fla_is_refused_unless_allowed(tiny_qwen35, monkeypatch):
    """Without fla, on a (pretended) CUDA device the check refuses and names the fix; the override lets it run.

    fla's absence is what the kernel report says (it is never installed on CPU boxes, docs/FACTS.md
    §2); where fla is installed the report is made to say so, so the test does not depend on what
    else is installed."""
    import workers.target as target

    real = target.kernel_report
    monkeypatch.setattr(target, "kernel_report", lambda model: {**real(model), "fla": False})
    assert is_gdn(tiny_qwen35.config)
    report = check_kernels(tiny_qwen35, torch.device("cpu"), Settings(_env_file=None))
    assert report["fla"] is False
    with pytest.raises(BadConfig, match="HSX_ALLOW_SLOW_KERNELS"):
        check_kernels(tiny_qwen35, torch.device("cuda"), Settings(_env_file=None))
    assert check_kernels(tiny_qwen35, torch.device("cuda"), Settings(_env_file=None, allow_slow_kernels=True))["fla"] is False


def test_a_dense_model_is_not_a_gdn_model(tmp_path):
    from transformers import LlamaConfig

    assert not is_gdn(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))


def test_the_row_count_warm_up_finds_the_gated_deltanet_mixers_and_only_those():
    """The warm-up that compiles fla's per-batch-size kernels calls the GDN token mixers: the
    linear-attention layers of a Qwen3.5 shape, none of a dense model."""
    from tinymodels import tiny_model
    from workers.target import linear_attention_modules

    qwen35 = tiny_model("qwen3.5")
    layer_types = qwen35.config.get_text_config().layer_types
    assert len(linear_attention_modules(qwen35)) == layer_types.count("linear_attention") > 0
    assert linear_attention_modules(tiny_model("qwen3")) == []


def _torch_gdn():
    """transformers' own torch implementation of the chunked gated delta rule (the CPU path), unwrapped."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    fn = m.torch_chunk_gated_delta_rule
    while isinstance(fn, RowsAsSequences):
        fn = fn.kernel
    return getattr(fn, "__wrapped__", fn)


def _varlen_reference(seen: list):
    """A variable-length kernel built from the torch one: each sequence of ``cu_seqlens`` on its own,
    from a zero state. Checks the chunk indices it is given against fla's definition
    (``fla.ops.utils.index.prepare_chunk_indices``: per sequence n, rows (n, 0..ceil(len/64)-1))."""
    torch_fn = _torch_gdn()

    def kernel(q, k, v, *args, g=None, beta=None, cu_seqlens=None, chunk_indices=None, **kw):
        assert q.shape[0] == 1 and cu_seqlens is not None
        cu = cu_seqlens.tolist()
        expect = [(n, c) for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])) for c in range(-(-(b - a) // 64))]
        assert [tuple(r) for r in chunk_indices.tolist()] == expect
        seen.append(tuple(q.shape))
        outs = [torch_fn(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], **kw)[0]
                for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(outs, 1), None

    return kernel


from workers.target import RowsAsSequences  # noqa: E402


def test_rows_as_sequences_gives_each_row_the_batched_kernels_values():
    """B right-padded rows through one variable-length row (B always 1 for the kernel) equal the batched call:
    3 rows of 100 tokens (2 chunks each), random q/k/v/g/beta, qk l2-norm in the kernel as transformers asks."""
    torch.manual_seed(0)
    B, T, H, K, V = 3, 100, 2, 16, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = -torch.rand(B, T, H)
    beta = torch.rand(B, T, H)
    seen: list = []
    wrapped = RowsAsSequences(_varlen_reference(seen))
    out, state = wrapped(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    want, _ = _torch_gdn()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert seen == [(1, B * T, H, K)] and out.shape == want.shape and state is None
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_a_gdn_model_patched_to_run_rows_as_sequences_gives_the_same_hidden_states():
    """A tiny Qwen3.5 (real config) with its GDN kernel swapped for RowsAsSequences over the reference
    variable-length kernel: every layer's output equals the unpatched model's on a right-padded batch."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from tinymodels import tiny_model

    model = tiny_model("qwen3.5").eval()
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (3, 70))
    with torch.inference_mode():
        want = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        seen: list = []
        saved = m.torch_chunk_gated_delta_rule
        m.torch_chunk_gated_delta_rule = RowsAsSequences(_varlen_reference(seen))
        try:
            got = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        finally:
            m.torch_chunk_gated_delta_rule = saved
    layer_types = model.config.get_text_config().layer_types
    assert len(seen) == layer_types.count("linear_attention") > 0
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"hidden state {i}")


def test_the_decode_warm_up_runs_the_gated_deltanet_recurrent_step_for_each_row_count(tiny_qwen35, monkeypatch, caplog):
    """A regenerate batch's decode steps run the recurrent gated delta rule, which no capture forward
    runs: the warm-up's two-token generate runs it once per row count of DECODE_WARM_UP_ROWS (on CUDA
    that compiles fla's kernel before the first batch; here the torch one runs), and logs no failure."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from workers.target import DECODE_WARM_UP_ROWS, _warm_up_decode

    rows_seen = []
    recurrent = m.torch_recurrent_gated_delta_rule

    def counting(query, *args, **kwargs):
        rows_seen.append(query.shape[0])
        return recurrent(query, *args, **kwargs)

    monkeypatch.setattr(m, "torch_recurrent_gated_delta_rule", counting)
    with caplog.at_level("WARNING", logger="workers.target"):
        _warm_up_decode(tiny_qwen35, pad=0)
    assert "decode warm-up failed" not in caplog.text
    per_layer = tiny_qwen35.config.get_text_config().layer_types.count("linear_attention")
    assert sorted(set(rows_seen)) == sorted(DECODE_WARM_UP_ROWS) and len(rows_seen) == per_layer * len(DECODE_WARM_UP_ROWS)


@pytest.mark.parametrize("heads", [(16, 32), (16, 48), (2, 4), (1,), (64, 64)])
@pytest.mark.parametrize("max_tokens", [1, 1000, 4096, 32768, 65536, 100_000])
def test_the_row_bucket_warm_up_meets_every_bucket_a_batch_can_meet_and_no_other(heads, max_tokens):
    """fla compiles its row-wise kernels once per bucket of 65,536 rows (``l2norm_fwd``'s ``NB``), rows
    being tokens x heads: the warm-up's token counts meet each bucket any forward of at most
    ``max_tokens`` padded tokens meets, each count at most ``max_tokens``, one count per bucket."""
    from workers.target import FLA_ROW_BUCKET, gdn_token_counts

    counts = gdn_token_counts(max_tokens, heads)
    assert counts == sorted(set(counts)) and all(1 <= t <= max_tokens for t in counts)
    for h in heads:
        warmed = {-(-t * h // FLA_ROW_BUCKET) for t in counts}
        step = max(1, max_tokens // 4000)  # every token count up to 100k would be slow; the bucket edges are below
        needed = {-(-t * h // FLA_ROW_BUCKET) for t in [*range(1, max_tokens + 1, step), max_tokens]}
        assert needed <= warmed
    assert len(counts) <= sum(-(-max_tokens * h // FLA_ROW_BUCKET) for h in set(heads))
    assert gdn_token_counts(0, heads) == []


def test_the_row_bucket_warm_up_calls_the_first_gated_deltanet_layer_once_per_token_count():
    """The warm-up runs the model's first GDN token mixer on ``[1, T, hidden]`` for each of the counts
    (here the tiny Qwen3-Next shape, 2 key and 4 value heads: 20,000 tokens are 80,000 rows at most,
    two buckets), with the model's own dtype and device; a dense model is left alone."""
    from tinymodels import tiny_model
    from workers.target import _warm_up_row_buckets, gdn_token_counts, linear_attention_modules

    model = tiny_model("qwen3-next")
    seen = []
    first = linear_attention_modules(model)[0]
    handle = first.register_forward_pre_hook(lambda module, args: seen.append((tuple(args[0].shape), args[0].dtype)))
    try:
        _warm_up_row_buckets(model, 20_000)
    finally:
        handle.remove()
    assert gdn_token_counts(20_000, (2, 4)) == [16384, 20000]
    assert seen == [((1, 16384, 64), torch.float32), ((1, 20000, 64), torch.float32)]
    _warm_up_row_buckets(tiny_model("qwen3"), 20_000)  # no GDN layer: nothing to call, no error


def test_a_groups_row_bucket_warm_up_runs_one_whole_forward_per_token_count_over_the_heads_of_a_rank():
    """A tensor-parallel group cannot call one layer on rank 0 alone (its followers would be left
    waiting in the next collective): its warm-up sends one whole single-row forward per token count
    through the group's launch. A rank of 2 holds half of each Gated DeltaNet layer's heads (tiny
    Qwen3-Next: 2 key and 4 value heads, so 1, 2 and 4 per rank or replicated), so the counts are
    those of those head counts; each forward really runs (its capture is waited for)."""
    from tinymodels import tiny_model
    from workers.capture import launch_capture
    from workers.target import _warm_up_group_row_buckets, gdn_token_counts

    model = tiny_model("qwen3-next")
    seen = []

    def lead(model, rows, selection, *, store_dtype):
        seen.append((tuple(rows.input_ids_BS.shape), int(rows.cu_seqlens_N1[-1]), list(selection.layer_ids)))
        return launch_capture(model, rows, selection, store_dtype=store_dtype)

    _warm_up_group_row_buckets(model, lead, 20_000, pad=0, ranks=2)
    counts = gdn_token_counts(20_000, (1, 2, 4))
    assert counts == [16384, 20000]
    n = model.config.num_hidden_layers
    assert seen == [((1, t), t, [n - 1]) for t in counts]
    seen.clear()
    _warm_up_group_row_buckets(tiny_model("qwen3"), lead, 20_000, pad=0, ranks=2)  # no GDN layer: no forward
    assert seen == []
