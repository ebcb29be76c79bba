"""The capture path (workers/capture.py) on tiny random models of ten target families.

Each model is built from its real config (tests/tinymodels.py): Llama-3.1, Qwen3, Qwen3.5
(Gated DeltaNet + gated attention), Qwen3-Next (Gated DeltaNet + MoE), and the MoE models Qwen3-30B-A3B,
gpt-oss-20b (sliding window, sinks), DeepSeek-V3 (latent attention), Mixtral, MiniMax-M2.5 and GLM-5
(sparse attention; its top-k above the row length, tinymodels says why). One right-padded
batch with lengths from 3 to 700 is captured once per model and checked against a per-sample,
unpadded ``output_hidden_states`` forward of the same model.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from tinymodels import MODELS, TINY_LAYERS, TINY_VOCAB, random_batch, reference_forward, tiny_model

from hsx.errors import BadConfig, FidelityError
from hsx.decoder import decoder_of
from hsx.layers import select_layers
from workers.capture import capture_batch, nonfinite_samples, right_padded_rows, split_by_tokens

#: one batch, right-padded to 700: short rows are mostly padding, the long one crosses many GDN chunks (64)
LENGTHS = [3, 17, 64, 129, 700, 255]
#: fp32 tolerance. Measured max |diff| batched vs per-sample (6 layers, states of magnitude ~5):
#: attention-only models ~5e-6; Gated DeltaNet ~4e-5, only in the last, partial 64-token chunk
#: of a sample, where the torch chunked kernel pads differently. Contamination between rows is O(1).
ATOL, RTOL = 1e-4, 1e-5


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    """allclose with the max |diff| and the tolerance in the failure message; returns the max diff."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), atol=ATOL, rtol=RTOL), (
        f"{what}: max |diff| {diff:.3g} > tolerance atol {ATOL} + rtol {RTOL} x |want|")
    return diff


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    """One tiny model, the batch captured with every layer and both final states, and per-sample references."""
    model = tiny_model(request.param)
    samples, ids_T, cu_N1 = random_batch(LENGTHS, seed=7)
    selection = select_layers(TINY_LAYERS, layer_ids=list(range(TINY_LAYERS)), final="both")
    captured = capture_batch(model, ids_T, cu_N1, selection, store_dtype=torch.float32)
    refs = [reference_forward(model, ids_S) for ids_S in samples]
    return SimpleNamespace(name=request.param, model=model, samples=samples, ids_T=ids_T, cu=cu_N1.tolist(),
                           selection=selection, captured=captured, refs=refs)


def per_sample(case, name: str):
    """(j, rows of sample j in the captured tensor ``name``, its reference)."""
    for j, ref in enumerate(case.refs):
        yield j, case.captured.states[name][case.cu[j]:case.cu[j + 1]], ref


def test_batched_capture_equals_per_sample_output_hidden_states_for_every_layer(case):
    """Slot k of a right-padded batch == the sample's own forward: HF hidden_states[id + 1] (id < N-1), the last layer's output (id N-1)."""
    worst, compared = 0.0, 0
    for j, hidden_SKH, ref in per_sample(case, "hidden_states"):
        for k, layer_id in enumerate(case.selection.layer_ids):
            want = ref["hidden_states"][layer_id + 1] if layer_id < TINY_LAYERS - 1 else ref["last_layer_SH"]
            worst = max(worst, assert_close(hidden_SKH[:, k], want, f"{case.name} sample {j} (len {LENGTHS[j]}) layer {layer_id}"))
            compared += want.numel()
    assert compared == sum(LENGTHS) * TINY_LAYERS * 64, "every token of every layer must have been compared"
    assert case.captured.nonfinite == {}
    print(f"{case.name}: batched vs per-sample, max |diff| {worst:.3g} over {compared} values (atol {ATOL})")


def test_final_postnorm_equals_hf_last_hidden_state(case):
    """final_postnorm (the model's own norm, zero-centred for Qwen3.5 / Qwen3-Next) == HF hidden_states[-1]."""
    worst = max(assert_close(post_SH, ref["hidden_states"][-1], f"{case.name} sample {j} final_postnorm")
                for j, post_SH, ref in per_sample(case, "final_postnorm"))
    print(f"{case.name}: final_postnorm max |diff| {worst:.3g}")


def test_final_prenorm_is_the_last_layers_output_and_equals_its_slot(case):
    """Asking for layer N-1 and --final both: prenorm == slot N-1 (bit for bit) == the raw output of layer N-1 != post-norm."""
    hidden_TKH, states = case.captured.states["hidden_states"], case.captured.states
    assert torch.equal(states["final_prenorm"], hidden_TKH[:, TINY_LAYERS - 1])
    for j, pre_SH, ref in per_sample(case, "final_prenorm"):
        assert_close(pre_SH, ref["last_layer_SH"], f"{case.name} sample {j} final_prenorm")
    # HF's hidden_states[N] is the post-norm state, not layer N-1's output: the norm must change the values.
    assert (states["final_prenorm"] - states["final_postnorm"]).abs().max() > 0.1


def test_lm_head_of_final_postnorm_equals_the_models_logits(case):
    """lm_head(final_postnorm) == the CausalLM's logits for the same sample run alone."""
    worst = max(assert_close(case.model.lm_head(post_SH), ref["logits_SV"], f"{case.name} sample {j} logits")
                for j, post_SH, ref in per_sample(case, "final_postnorm"))
    print(f"{case.name}: logits max |diff| {worst:.3g}")


def test_a_single_row_batch_equals_the_per_sample_forward(case):
    """A batch of one row (the 700-token sample, no padding, all-ones mask) == its own forward."""
    j = LENGTHS.index(700)
    ids_S = case.samples[j]
    captured = capture_batch(case.model, ids_S, torch.tensor([0, len(ids_S)]), case.selection, store_dtype=torch.float32)
    ref = case.refs[j]
    for k, layer_id in enumerate(case.selection.layer_ids[:-1]):
        assert_close(captured.states["hidden_states"][:, k], ref["hidden_states"][layer_id + 1], f"{case.name} single row layer {layer_id}")
    assert_close(captured.states["final_postnorm"], ref["hidden_states"][-1], f"{case.name} single row final_postnorm")


def test_a_batch_of_one_right_padded_row_equals_the_unpadded_row(case):
    """One row right-padded with its 2-D mask (batch size 1, transformers PR 46773) == the row unpadded."""
    ids_S = case.samples[LENGTHS.index(129)]
    padded_1S = torch.zeros((1, 200), dtype=torch.long)
    padded_1S[0, :129] = ids_S
    mask_1S = torch.zeros((1, 200), dtype=torch.long)
    mask_1S[0, :129] = 1
    with torch.inference_mode():
        got = case.model.model(input_ids=padded_1S, attention_mask=mask_1S, use_cache=False, output_hidden_states=True).hidden_states
    ref = case.refs[LENGTHS.index(129)]["hidden_states"]
    for i in range(1, len(ref)):
        assert_close(got[i][0, :129], ref[i], f"{case.name} padded single row hidden_states[{i}]")


class CallCounter:
    """Counts forward calls of each decoder layer and of the final norm."""

    def __init__(self, model):
        decoder = decoder_of(model)
        self.calls = {i: 0 for i in range(len(decoder.layers))}
        self.calls["norm"] = 0
        self.handles = [layer.register_forward_pre_hook(self._count(i)) for i, layer in enumerate(decoder.layers)]
        self.handles.append(decoder.norm.register_forward_pre_hook(self._count("norm")))

    def _count(self, key):
        def hook(_module, _args):
            self.calls[key] += 1
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("final, layer_ids, runs_up_to, norm_runs", [
    ("none", [1, 3], 3, False),          # stop after the deepest asked layer
    ("prenorm", [1, 3], TINY_LAYERS - 1, False),  # every layer, but not the norm
    ("postnorm", [1, 3], TINY_LAYERS - 1, True),
])
def test_the_forward_stops_after_the_deepest_needed_layer(case, final, layer_ids, runs_up_to, norm_runs):
    """Layers after the deepest needed one (and the norm, unless post-norm is asked) never run; the values are identical."""
    selection = select_layers(TINY_LAYERS, layer_ids=layer_ids, final=final)
    counter = CallCounter(case.model)
    try:
        captured = capture_batch(case.model, case.ids_T, torch.tensor(case.cu), selection, store_dtype=torch.float32)
    finally:
        counter.remove()
    assert counter.calls == {**{i: int(i <= runs_up_to) for i in range(TINY_LAYERS)}, "norm": int(norm_runs)}
    full = case.captured.states
    assert torch.equal(captured.states["hidden_states"], full["hidden_states"][:, layer_ids])
    finals = {"none": [], "prenorm": ["final_prenorm"], "postnorm": ["final_postnorm"]}[final]
    assert sorted(captured.states) == sorted(["hidden_states", *finals])
    for name in finals:
        assert torch.equal(captured.states[name], full[name])


# --- models outside transformers 5's shape: tuple-returning layers, other norm names, no norm ---------

class TupleLayer(torch.nn.Module):
    """A decoder layer as in transformers 4.x: returns ``(hidden, attn_weights)``; token-wise, so no mixing."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, hidden_BSH, attention_mask=None):
        return hidden_BSH + torch.tanh(self.proj(hidden_BSH)), None


class ToyDecoder(torch.nn.Module):
    def __init__(self, norm_name: str | None, hidden: int = 16, layers: int = 4):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(TINY_VOCAB, hidden)
        self.layers = torch.nn.ModuleList(TupleLayer(hidden) for _ in range(layers))
        self.norm_name = norm_name
        if norm_name:
            setattr(self, norm_name, torch.nn.LayerNorm(hidden))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        hidden_BSH = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_BSH = layer(hidden_BSH, attention_mask)[0]
        return getattr(self, self.norm_name)(hidden_BSH) if self.norm_name else hidden_BSH

    def reference(self, ids_S):
        """[output of layer i for each i] and the post-norm state, for one unpadded sample."""
        outs, hidden_SH = [], self.embed_tokens(ids_S)
        for layer in self.layers:
            hidden_SH = layer(hidden_SH)[0]
            outs.append(hidden_SH)
        return outs, (getattr(self, self.norm_name)(hidden_SH) if self.norm_name else None)


class ToyForCausalLM(torch.nn.Module):
    def __init__(self, norm_name: str | None):
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyDecoder(norm_name)


@pytest.mark.parametrize("norm_name", ["final_layernorm", "ln_f"])
def test_tuple_returning_layers_and_other_norm_names_are_captured(norm_name):
    """Layers that return (hidden, weights) tuples and a final norm not called .norm: slots and finals == per-sample reference."""
    model = ToyForCausalLM(norm_name).eval()
    samples, ids_T, cu = random_batch([5, 2, 9], seed=3)
    captured = capture_batch(model, ids_T, cu, select_layers(4, layer_ids=[0, 2, 3], final="both"), store_dtype=torch.float32)
    with torch.inference_mode():
        for j, ids_S in enumerate(samples):
            outs, post = model.model.reference(ids_S)
            rows = slice(int(cu[j]), int(cu[j + 1]))
            for k, layer_id in enumerate([0, 2, 3]):
                assert_close(captured.states["hidden_states"][rows, k], outs[layer_id], f"toy sample {j} layer {layer_id}")
            assert_close(captured.states["final_prenorm"][rows], outs[3], f"toy sample {j} prenorm")
            assert_close(captured.states["final_postnorm"][rows], post, f"toy sample {j} postnorm")


def test_a_model_without_a_final_norm_captures_layers_and_refuses_postnorm():
    """No final norm module: layers and the pre-norm state are captured; a post-norm request is refused by name."""
    model = ToyForCausalLM(None).eval()
    samples, ids_T, cu = random_batch([4, 6], seed=4)
    captured = capture_batch(model, ids_T, cu, select_layers(4, layer_ids=[1], final="prenorm"), store_dtype=torch.float32)
    with torch.inference_mode():
        outs, _ = model.model.reference(samples[1])
    assert_close(captured.states["final_prenorm"][4:], outs[3], "no-norm toy prenorm")
    with pytest.raises(BadConfig, match=r"--final postnorm: ToyForCausalLM has no final norm module .*final_layernorm.*use --final prenorm or none"):
        capture_batch(model, ids_T, cu, select_layers(4, layer_ids=[1], final="postnorm"), store_dtype=torch.float32)


def test_a_selection_made_for_another_layer_count_is_refused():
    """A 6-layer selection on a 4-layer model would point at other layers: refused before any forward."""
    model = ToyForCausalLM("ln_f").eval()
    _, ids_T, cu = random_batch([4], seed=5)
    with pytest.raises(FidelityError, match="has 4 decoder layers but the layer selection was made for 6"):
        capture_batch(model, ids_T, cu, select_layers(6, layer_ids=[1]), store_dtype=torch.float32)


def test_two_threads_capturing_on_one_model_never_see_each_others_activations():
    """Thread A is paused inside its forward while thread B runs a same-shape batch on the same model: both == their references."""
    model = tiny_model("qwen3", num_layers=4)
    selection = select_layers(4, layer_ids=[0, 1, 2], final="postnorm")
    batches = {"a": random_batch([40, 25], seed=10), "b": random_batch([40, 25], seed=11)}
    a_paused, b_done = threading.Event(), threading.Event()
    a_thread: list[int] = []

    def pause_a(_module, _args, _output):  # registered before capture's hooks, so it runs first
        if threading.get_ident() in a_thread:
            a_paused.set()
            assert b_done.wait(60), "thread B never finished"

    handle = model.model.layers[3].register_forward_hook(pause_a)
    results, errors = {}, []

    def run(name):
        try:
            if name == "a":
                a_thread.append(threading.get_ident())
            _, ids_T, cu = batches[name]
            results[name] = capture_batch(model, ids_T, cu, selection, store_dtype=torch.float32)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            if name == "b":
                b_done.set()

    try:
        thread_a = threading.Thread(target=run, args=("a",))
        thread_a.start()
        assert a_paused.wait(60), "thread A never reached layer 3"
        run("b")  # while A holds its hooks on layers 0-2 and its layers 0-2 are already captured
        thread_a.join(60)
    finally:
        handle.remove()
    assert not errors, errors
    for name, (samples, _, cu) in batches.items():
        for j, ids_S in enumerate(samples):
            ref = reference_forward(model, ids_S)
            for k in range(3):
                assert_close(results[name].states["hidden_states"][cu[j]:cu[j + 1], k], ref["hidden_states"][k + 1],
                             f"thread {name} sample {j} layer {k}")


def test_nonfinite_samples_names_each_sample_and_the_parts_that_hold_nan_or_inf():
    """NaN in one sample's layer slot and Inf in another's final state: each sample listed with exactly those parts."""
    cu_N1 = torch.tensor([0, 3, 5, 9])
    states = {"hidden_states": torch.zeros(9, 2, 4), "final_postnorm": torch.zeros(9, 4)}
    assert nonfinite_samples(states, cu_N1, [1, 5]) == {}
    states["hidden_states"][4, 1, 2] = float("nan")  # sample 1 (rows 3-4), layer id 5
    states["final_postnorm"][8, 0] = float("-inf")  # sample 2 (rows 5-8)
    states["hidden_states"][5, 0, 0] = float("inf")  # sample 2, layer id 1
    assert nonfinite_samples(states, cu_N1, [1, 5]) == {1: ["5"], 2: ["1", "final_postnorm"]}


def test_right_padding_needs_no_mask_what_fills_it_never_reaches_a_sample_and_left_padding_would(case):
    """Rows run without an attention mask: the pad id does not change one captured bit, because every
    layer is causal; padding placed BEFORE a sample (left) would change it by O(1), which is why rows are
    right-padded."""
    other_pad = capture_batch(case.model, case.ids_T, torch.tensor(case.cu), case.selection,
                              store_dtype=torch.float32, pad_token_id=TINY_VOCAB - 1)
    for name, tensor in case.captured.states.items():
        assert torch.equal(other_pad.states[name], tensor), f"{case.name}: {name} depends on the padding's ids"
    ids_S = case.samples[LENGTHS.index(129)]
    left_1S = torch.cat([torch.full((1, 71), 5, dtype=torch.long), ids_S[None]], dim=1)
    with torch.inference_mode():
        got = case.model.model(input_ids=left_1S, use_cache=False, output_hidden_states=True).hidden_states
    want = case.refs[LENGTHS.index(129)]["hidden_states"]
    assert (got[2][0, 71:] - want[2]).abs().max() > 0.1, f"{case.name}: left padding without a mask left layer 1 unchanged"


def test_right_padded_rows_puts_token_t_of_sample_j_at_row_j_and_lists_the_valid_positions_in_order():
    """The row layout: sample j in row j from column 0, pad after it; valid_T walks the samples' tokens in input order."""
    ids_T = torch.arange(10, 20)
    rows = right_padded_rows(ids_T, torch.tensor([0, 3, 4, 10]), pad_token_id=-1)
    assert rows.shape == (3, 6, 10)
    assert rows.input_ids_BS.tolist() == [[10, 11, 12, -1, -1, -1], [13, -1, -1, -1, -1, -1], [14, 15, 16, 17, 18, 19]]
    assert torch.equal(rows.input_ids_BS.view(-1)[rows.valid_T], ids_T)
    with pytest.raises(FidelityError, match="cu_seqlens"):
        right_padded_rows(ids_T, torch.tensor([0, 3, 3, 10]))


def test_split_by_tokens_cuts_consecutive_samples_so_each_forward_fits_the_limit():
    """Ranges cover the batch in order; rows x longest row of each stay within the limit; a sample
    longer than the limit gets a forward of its own; no limit (or a batch that fits) is one range."""
    cu = torch.tensor([0, 10, 20, 35, 50, 150, 160])  # lengths 10, 10, 15, 15, 100, 10
    assert split_by_tokens(cu, None) == [(0, 6)] and split_by_tokens(cu, 600) == [(0, 6)]
    ranges = split_by_tokens(cu, 45)
    assert ranges == [(0, 3), (3, 4), (4, 5), (5, 6)]
    lengths = (cu[1:] - cu[:-1]).tolist()
    for a, b in ranges:
        assert (b - a) * max(lengths[a:b]) <= 45 or b - a == 1


def test_merge_captured_concatenates_ranges_and_shifts_nonfinite_positions_to_the_batch():
    from workers.capture import CapturedBatch, merge_captured

    a = CapturedBatch({"hidden_states": torch.zeros(3, 2, 4)}, {1: ["5"]})
    b = CapturedBatch({"hidden_states": torch.ones(5, 2, 4)}, {0: ["1", "5"]})
    merged = merge_captured([a, b], [0, 2])
    assert merged.states["hidden_states"].shape == (8, 2, 4) and merged.states["hidden_states"][3:].eq(1).all()
    assert merged.nonfinite == {1: ["5"], 2: ["1", "5"]}


def test_the_packed_sequence_check_is_answered_without_a_sync_only_inside_our_forward():
    """launch_capture answers transformers' packed-sequence check itself (our rows are never
    packed, and the check's .all() would make the host wait for the previous batch's forward);
    outside our forward, transformers' own function still finds packed sequences."""
    import transformers.masking_utils as masking_utils

    from workers import capture

    capture._skip_packed_sequence_check()
    capture._skip_packed_sequence_check()  # installed once: a second call does not wrap it again
    check = masking_utils.find_packed_sequence_indices
    assert check.hsx_unpacked_rows and not getattr(check.original, "hsx_unpacked_rows", False)
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert check(packed).tolist() == [[0, 0, 0, 1, 1, 2]]
    assert check(torch.arange(6)[None]) is None
