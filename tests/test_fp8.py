"""``--store-dtype fp8``: float8 e4m3 hidden states with one float32 scale per token and part.

From the bottom up: the quantise / dequantise functions (hsx/fp8.py) against e4m3's error bound
on tensors with outliers and zero rows; the capture path quantising on the device after its NaN/Inf
flags; a worker's batch with NaN and Inf injected (still quarantined); and a whole fp8 run made by
``python -m producer run`` (embedded broker, worker process) next to the same job in bf16
(tests/smallrun.py): its shards' dtypes, the reader's dequantised output against the bf16 run,
``verify --recompute`` with the fp8 tolerance, and an export that holds no fp8.
"""

from __future__ import annotations

import json

import pytest
import torch

from jobfixtures import clean_env, cli_json, run_here
from smallrun import SMALL_JOB
from tinymodels import random_batch, tiny_model

from hsx.fp8 import (E4M3_MAX, FP8_DTYPE, TOKEN_MAX_REL_ERR, dequantize_fp8, error_bound, quantize_fp8,
                      bytes_per_token)
from hsx.layers import select_layers
from workers.capture import capture_batch

#: float32 arithmetic around the e4m3 rounding (amax / 448, x / scale, q * scale) moves a value by
#: a few parts in 2**24; the bounds are checked with this relative slack.
SLACK = 1e-6


def outlier_tensor(seed: int = 0) -> torch.Tensor:
    """[T=300, K=3, H=512] float32: Gaussian rows with outlier channels (x50), one massive token
    (x1e4, as BOS activations are), heavy-tailed (Cauchy) rows, rows of tiny magnitude (1e-20) and
    rows spanning 30 orders of magnitude (values below e4m3's subnormal range after scaling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 3, 512, generator=g)
    x[:, :, [7, 100, 301]] *= 50.0
    x[0] *= 1e4
    x[10:40] = torch.distributions.Cauchy(0.0, 1.0).sample((30, 3, 512))
    x[50:60] *= 1e-20
    x[60:70] *= torch.logspace(-15, 15, 512)
    return x


def check_within_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple[float, float]:
    """Assert the elementwise and per-token bounds of hsx/fp8.py; return (worst token max-abs relative
    error, global relative Frobenius error)."""
    x = x.float()
    dq = dequantize_fp8(q, scale, torch.float32)
    err = (dq - x).abs()
    bound = error_bound(x, scale)
    worst = (err / bound.clamp_min(1e-45)).max().item()
    assert (err <= bound * (1 + SLACK) + 1e-44).all(), f"elementwise bound broken: worst {worst:.4f}x the bound"
    amax = x.abs().amax(dim=-1)
    nonzero = amax > 0
    token_rel = err.amax(dim=-1)[nonzero] / amax[nonzero]
    assert token_rel.max().item() <= TOKEN_MAX_REL_ERR * (1 + SLACK), f"per-token max-abs relative {token_rel.max():.5f}"
    return token_rel.max().item(), ((dq - x).norm() / x.norm()).item()


def test_round_trip_stays_within_the_e4m3_bound_on_tensors_with_outliers():
    """|dq - x| <= 2**-4 |x| + 2**-10 scale elementwise; per token max|dq - x| <= max|x| / 28;
    each row's largest value maps to +-448, so one token's outlier costs no other token precision."""
    x = outlier_tensor()
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    torch.testing.assert_close(scale, x.abs().amax(dim=-1) / E4M3_MAX)
    assert (q.float().abs().amax(dim=-1) == E4M3_MAX).all()
    token_max_rel, frobenius = check_within_bound(x, q, scale)
    assert token_max_rel > 0.02, "the outlier rows must exercise the top binade"
    assert frobenius < 2**-4
    # The Gaussian rows around the massive token keep their own precision.
    _, rest = check_within_bound(x[1:10], q[1:10], scale[1:10])
    assert rest < 0.05


def test_bf16_input_and_bf16_output_round_trip():
    """A bf16 activation quantises the same way; dequantising to bf16 (the readers' default) adds only bf16's rounding (2**-8 relative)."""
    x = outlier_tensor(1)[:, 0].to(torch.bfloat16)  # [T, H], as a final state
    q, scale = quantize_fp8(x)
    assert scale.shape == (300,)
    check_within_bound(x, q, scale)
    dq = dequantize_fp8(q, scale)
    assert dq.dtype == torch.bfloat16
    xf = x.float()
    assert ((dq.float() - xf).abs() <= error_bound(xf, scale) * (1 + SLACK) + 2**-8 * dq.float().abs() + 1e-44).all()


def test_zero_rows_get_scale_one_and_dequantise_to_exact_zeros():
    """A row of zeros (a token whose layer output is exactly 0) has scale 1: no division by zero, no NaN, zeros back."""
    x = torch.randn(4, 2, 16)
    x[1] = 0.0
    x[3, 1] = 0.0
    x[2, 0] = -0.0
    q, scale = quantize_fp8(x)
    assert scale[1].tolist() == [1.0, 1.0] and scale[3, 1] == 1.0 and scale[2, 0] == 1.0
    dq = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(dq).all()
    assert (dq[1] == 0).all() and (dq[3, 1] == 0).all() and (dq[2, 0] == 0).all()
    check_within_bound(x, q, scale)


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe of the module docstring, step by step (the implementation before it was fused):
    |x|, amax, scale 1 for zero rows, the float32 quotient, a clamp to +-448, the cast."""
    scale = x.abs().amax(dim=-1).to(torch.float32) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.div(x, scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_quantisation_is_bit_equal_to_the_step_by_step_recipe(dtype):
    """Cast on store with no clamp, and written through ``out`` into a strided slot: the same bytes
    and scales as the recipe, on outliers, massive tokens, zero rows and 30 orders of magnitude."""
    from hsx.fp8 import quantize_states, row_amax

    x = outlier_tensor(3).to(dtype)
    x[5] = 0
    x[6, 1] = torch.finfo(dtype).max  # the largest finite value: its quotient is exactly 448
    want_q, want_scale = reference_quantize(x)
    q, scale = quantize_fp8(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    slots = torch.empty((x.shape[0], 2, *x.shape[1:]), dtype=FP8_DTYPE)
    quantize_fp8(x, row_amax(x), out=slots[:, 1])
    assert torch.equal(slots[:, 1].view(torch.uint8), want_q.view(torch.uint8))
    out = quantize_states({"hidden_states": x, "final_postnorm": x[:, 0]}, {"hidden_states": row_amax(x)})
    assert list(out) == ["hidden_states", "hidden_states_scale", "final_postnorm", "final_postnorm_scale"]
    assert torch.equal(out["hidden_states"].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(out["final_postnorm_scale"], want_scale[:, 0])


def test_row_amax_is_not_finite_exactly_where_a_row_holds_nan_or_inf():
    """The capture path's NaN/Inf flags come from the rows' max |x|: NaN, +-Inf, and NaN beside an
    Inf in one row are all caught; finite rows, however large, are not."""
    from hsx.fp8 import row_amax

    x = torch.randn(8, 4, 16, dtype=torch.bfloat16)
    x[0, 1, 3] = float("nan")
    x[1, 0, 0] = float("inf")
    x[2, 3, 15] = float("-inf")
    x[3, 2, 4], x[3, 2, 5] = float("inf"), float("nan")
    x[4, 0] = torch.finfo(torch.bfloat16).max
    assert torch.equal(torch.isfinite(row_amax(x)), torch.isfinite(x).all(dim=-1))
    assert row_amax(x).dtype == torch.float32 and row_amax(x).shape == (8, 4)


def test_dequantize_refuses_a_scale_of_another_shape():
    q, scale = quantize_fp8(torch.randn(5, 3, 8))
    with pytest.raises(ValueError, match=r"needs a scale of shape \(5, 3\)"):
        dequantize_fp8(q, scale[:, :2])


def test_bytes_per_token_counts_the_scales():
    """DFlash on Qwen3.5-27B (5 layers, H 5120): 51,200 bytes per token in bf16, 25,620 in fp8 (0.5004x)."""
    assert bytes_per_token(5, 5120, "bfloat16") == 51_200
    assert bytes_per_token(5, 5120, "fp8") == 25_620


# --- the capture path -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35():
    return tiny_model("qwen3.5")


def test_capture_in_fp8_holds_e4m3_states_and_scales_within_the_bound_of_the_fp32_capture(qwen35):
    """One right-padded batch captured twice: fp8 states + float32 scales, dequantised within e4m3's bound of the fp32 states."""
    _, ids_T, cu = random_batch([3, 40, 129, 17], seed=11)
    selection = select_layers(6, layer_ids=[0, 2, 4], final="both")
    ref = capture_batch(qwen35, ids_T, cu, selection, store_dtype=torch.float32)
    got = capture_batch(qwen35, ids_T, cu, selection, store_dtype=FP8_DTYPE)
    T = int(cu[-1])
    assert {n: (t.dtype, tuple(t.shape)) for n, t in got.states.items()} == {
        "hidden_states": (FP8_DTYPE, (T, 3, 64)), "hidden_states_scale": (torch.float32, (T, 3)),
        "final_postnorm": (FP8_DTYPE, (T, 64)), "final_postnorm_scale": (torch.float32, (T,)),
        "final_prenorm": (FP8_DTYPE, (T, 64)), "final_prenorm_scale": (torch.float32, (T,)),
    }
    assert got.nonfinite == {} == ref.nonfinite
    for name in ("hidden_states", "final_postnorm", "final_prenorm"):
        x = ref.states[name]
        torch.testing.assert_close(got.states[name + "_scale"], x.abs().amax(dim=-1) / E4M3_MAX)
        check_within_bound(x, got.states[name], got.states[name + "_scale"])


def test_nan_and_inf_are_flagged_on_the_unquantised_values_under_fp8(qwen35):
    """Inf in sample 0 and NaN in sample 2 from layer 2 on: fp8 flags the same samples and parts as fp32
    (e4m3fn has no Inf: the flags must be taken before the cast)."""
    _, ids_T, cu = random_batch([5, 9, 7], seed=12)
    lengths = [5, 9, 7]

    def poison(_module, _args, output):
        hidden_BSH = (output[0] if isinstance(output, tuple) else output).clone()
        hidden_BSH[0, : lengths[0], 3] = float("inf")
        hidden_BSH[2, 1, :] = float("nan")
        return (hidden_BSH, *output[1:]) if isinstance(output, tuple) else hidden_BSH

    selection = select_layers(6, layer_ids=[1, 2, 4], final="postnorm")
    handle = qwen35.model.layers[2].register_forward_hook(poison)
    try:
        ref = capture_batch(qwen35, ids_T, cu, selection, store_dtype=torch.float32)
        got = capture_batch(qwen35, ids_T, cu, selection, store_dtype=FP8_DTYPE)
    finally:
        handle.remove()
    assert set(ref.nonfinite) == {0, 2}
    assert got.nonfinite == ref.nonfinite
    assert got.nonfinite[0][:2] == ["2", "4"]  # layer 1 is before the poison


# --- a worker's batch -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_planned(tmp_path_factory, tiny_cache):
    """A run planned in-process with --store-dtype fp8: 16 ShareGPT records, EAGLE-3 ids + post-norm."""
    from producer.planner import PlanOptions, plan_run
    from settings import Settings

    tmp = tmp_path_factory.mktemp("fp8-extract")
    settings = Settings(_env_file=None, cache_dir=tiny_cache, spool_dir=tmp / "spool", device="cpu", store_url=str(tmp / "out"))
    opts = PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp / "out"), limit=16, max_length=256,
                       batch_tokens=1024, store_dtype="fp8")
    run = plan_run(opts, settings)
    assert run.config.store_dtype == "fp8"
    batches = [b.batch for b in run.batches if b.num_samples >= 3]
    return {"run": run, "settings": settings, "batches": batches}


def test_nan_and_inf_samples_are_still_quarantined_under_fp8(fp8_planned):
    """NaN in one sample and Inf in another from layer 2 on: both quarantined with their parts named;
    the shard holds the rest as F8_E4M3 + F32 scales, finite after dequantisation."""
    from safetensors import safe_open

    from hsx.records import Marker
    from hsx.plan import read_batch
    from workers.extract import extract_batch
    from workers.target import get_target

    run, settings = fp8_planned["run"], fp8_planned["settings"]
    batch = fp8_planned["batches"][0]
    plan = read_batch(run.run_store, batch)
    lengths = plan.lengths_N.tolist()
    shape = (len(lengths), max(lengths))

    def poison(_module, _args, output):
        hidden_BSH = output[0] if isinstance(output, tuple) else output
        if tuple(hidden_BSH.shape[:2]) != shape:
            return None
        hidden_BSH = hidden_BSH.clone()
        hidden_BSH[0, : lengths[0]] = float("nan")
        hidden_BSH[2, lengths[2] - 1, 5] = float("-inf")
        return (hidden_BSH, *output[1:]) if isinstance(output, tuple) else hidden_BSH

    target = get_target("tiny-qwen3.5", settings)
    handle = target.model.model.layers[2].register_forward_hook(poison)
    try:
        result = extract_batch(run.run_url, batch, settings)
    finally:
        handle.remove()
    assert result["status"] == "done" and result["num_quarantined"] == 2
    marker = Marker.read(run.run_store, batch)
    victims = [int(plan.sample_index_N[0]), int(plan.sample_index_N[2])]
    assert [q.model_dump() for q in marker.quarantined] == [
        {"sample_index": s, "reason": "nonfinite hidden states (layers 3, 4, final_postnorm)"} for s in victims]
    path = run.run_store.local_path(marker.shard.key)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert dtypes == {"input_ids": "I32", "loss_mask": "U8", "cu_seqlens": "I64", "sample_index": "I64",
                      "hidden_states": "F8_E4M3", "hidden_states_scale": "F32",
                      "final_postnorm": "F8_E4M3", "final_postnorm_scale": "F32"}
    assert meta["store_dtype"] == "fp8" and "amax(|x|) / 448" in meta["fp8_scaling"]
    assert not set(victims) & set(t["sample_index"].tolist())
    T = marker.num_tokens
    assert t["hidden_states"].shape == (T, 3, 64) and t["hidden_states_scale"].shape == (T, 3)
    assert torch.isfinite(dequantize_fp8(t["hidden_states"], t["hidden_states_scale"], torch.float32)).all()
    assert torch.isfinite(t["final_postnorm_scale"]).all() and (t["final_postnorm_scale"] > 0).all()


# --- a whole run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_run(small_run, tmp_path_factory, shared_worker):
    """The shared small job (tests/smallrun.py) again with --store-dtype fp8, by ``producer run`` on the shared worker."""
    tmp = tmp_path_factory.mktemp("fp8-run")
    env = clean_env(cache_dir=small_run["cache"], state_dir=tmp / "state", spool_dir=tmp / "spool")
    report = cli_json(shared_worker.producer(["run", *SMALL_JOB, "--store-dtype", "fp8", "--output", str(tmp / "out"), "--json"], env))
    assert report["batches_done"] == report["batches_total"] == small_run["report"]["batches_total"], report
    assert report["run_id"] != small_run["report"]["run_id"], "the store dtype is part of the run's identity"
    return {"dir": tmp / "out" / report["run_id"], "address": str(tmp / "out" / report["run_id"]), "report": report, "env": env}


def test_an_fp8_run_stores_e4m3_states_with_their_scales_and_about_half_the_bytes(fp8_run, small_run):
    from safetensors import safe_open

    from hsx.runconfig import load_run
    from hsx.store import open_store

    config = load_run(open_store(fp8_run["address"]))
    assert config.store_dtype == "fp8"
    shards = sorted((fp8_run["dir"] / "shards").glob("*.safetensors"))
    assert len(shards) == fp8_run["report"]["batches_total"]
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        T = shapes["input_ids"][0]
        assert {k: dtypes[k] for k in dtypes if "hidden" in k or "final" in k} == {
            "hidden_states": "F8_E4M3", "hidden_states_scale": "F32", "final_postnorm": "F8_E4M3",
            "final_postnorm_scale": "F32", "final_prenorm": "F8_E4M3", "final_prenorm_scale": "F32"}
        assert shapes["hidden_states_scale"] == [T, 3] and shapes["final_prenorm_scale"] == [T]
    fp8_bytes = sum(p.stat().st_size for p in shards)
    bf16_bytes = sum(p.stat().st_size for p in (small_run["dir"] / "shards").glob("*.safetensors"))
    # H = 64: states are (64 + 4) / 128 of bf16's; ids, masks and headers are the same in both.
    assert 0.5 < fp8_bytes / bf16_bytes < 0.6, (fp8_bytes, bf16_bytes)


def test_the_reader_returns_bf16_states_of_an_fp8_run_within_the_bound_of_the_bf16_run(fp8_run, small_run):
    """HiddenStatesDataset on the fp8 run == the same sample of the bf16 run, per token within
    1/28 of its largest value (+ bf16's rounding on both sides); raw=True gives the stored fp8 and scales."""
    from hsx.reader import HiddenStatesDataset, IterableHiddenStatesDataset

    fp8_ds, bf16_ds = HiddenStatesDataset(fp8_run["address"]), HiddenStatesDataset(small_run["address"])
    assert len(fp8_ds) == len(bf16_ds) > 0
    assert fp8_ds.sample_indices.tolist() == bf16_ds.sample_indices.tolist()
    worst = 0.0
    for i in range(len(fp8_ds)):
        a, b = fp8_ds[i], bf16_ds[i]
        assert a["sample_index"] == b["sample_index"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for name in ("hidden_states", "final_postnorm", "final_prenorm"):
            assert a[name].dtype == torch.bfloat16 and a[name].shape == b[name].shape
            got, want = a[name].float(), b[name].float()
            if name == "hidden_states":
                got, want = got.view(got.shape[0], 3, -1), want.view(want.shape[0], 3, -1)
            rel = (got - want).abs().amax(dim=-1) / want.abs().amax(dim=-1)
            worst = max(worst, rel.max().item())
    # 1/28 from e4m3, 2**-8 from each side's bf16 rounding, relative to the bf16 run's (rounded) max.
    assert 0.005 < worst <= (TOKEN_MAX_REL_ERR + 2 * 2**-8) / (1 - 2**-8), worst

    raw = HiddenStatesDataset(fp8_run["address"], raw=True)[0]
    assert raw["hidden_states"].dtype == FP8_DTYPE and raw["hidden_states_scale"].dtype == torch.float32
    S = raw["input_ids"].shape[0]
    assert raw["hidden_states_scale"].shape == (S, 3) and raw["final_postnorm_scale"].shape == (S,)
    exact = dequantize_fp8(raw["hidden_states"].view(S, 3, -1), raw["hidden_states_scale"], torch.float32)
    as_fp32 = HiddenStatesDataset(fp8_run["address"], dequant_dtype=torch.float32)[0]["hidden_states"]
    assert torch.equal(as_fp32, exact.reshape(S, -1))
    streamed = next(iter(IterableHiddenStatesDataset(fp8_run["address"])))
    assert streamed["hidden_states"].dtype == torch.bfloat16


def test_verify_recompute_passes_on_an_fp8_run_with_the_fp8_tolerance_and_still_catches_a_wrong_layer(fp8_run):
    import dataclasses

    from hsx.records import Marker
    from hsx.plan import read_batch
    from hsx.runconfig import load_run
    from hsx.store import open_store
    from producer.verify import recompute_samples
    from settings import Settings

    proc = run_here(["verify", fp8_run["address"], "--recompute", "4", "--json"], fp8_run["env"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["problems"] == []
    rec = report["recompute"]
    assert rec["rtol"] == 0.075 and len(rec["samples"]) == 4
    # e4m3's rounding is visible (bf16 would be ~0.1x of the tolerance), yet within the bound.
    assert 0.1 < rec["worst_ratio"] <= 1.0, rec

    run_store = open_store(fp8_run["address"])
    config = load_run(run_store)
    shifted = dataclasses.replace(config, layers=config.layers.model_copy(
        update={"layer_ids": tuple(i + 1 for i in config.layers.layer_ids)}))
    marker = Marker.read(run_store, "b000000")
    plan = read_batch(run_store, "b000000")
    picks = [("b000000", marker, int(plan.sample_index_N[0]), int(plan.cu_seqlens_N1[0]), int(plan.cu_seqlens_N1[1]))]
    settings = Settings(_env_file=None, cache_dir=fp8_run["env"]["HSX_CACHE_DIR"])
    summary, problems = recompute_samples(run_store, shifted, picks, settings)
    assert [p.kind for p in problems] == ["recompute_mismatch"] and summary["worst_ratio"] > 2, summary


def test_a_speculators_export_of_an_fp8_run_holds_bf16_equal_to_the_reader(fp8_run, tmp_path):
    from safetensors.torch import load_file

    from hsx.reader import HiddenStatesDataset

    out = tmp_path / "spec"
    report = cli_json(run_here(["export", fp8_run["address"], "--format", "speculators", str(out), "--json"],
                              fp8_run["env"]))
    assert report["store_dtype"] == "fp8" and report["hidden_dtype"] == "bfloat16"
    exported = json.loads((out / "export.json").read_text())
    ds = HiddenStatesDataset(fp8_run["address"])
    sample = ds[ds.position_of(exported["sample_index"][0])]
    hs = load_file(str(out / "hidden_states" / "hs_0.safetensors"))["hidden_states"]
    S = sample["input_ids"].shape[0]
    assert hs.dtype == torch.bfloat16 and hs.shape == (S, 4, 64)
    assert torch.equal(hs[:, :3].reshape(S, -1), sample["hidden_states"])
    assert torch.equal(hs[:, 3], sample["final_prenorm"])
