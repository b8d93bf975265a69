"""Decode padding for CUDA graphs: a padded decode step gives the real rows the logits of the unpadded step
(torch backend and the Triton kernel with a fixed split count, on CPU), and on CUDA a replayed graph gives the
logits of the eager forward. The padded sampler (what the sampler graph runs: all B rows, neutral padding rows)
gives the real rows the unpadded sampler's tokens, logprobs and masks, eagerly on CPU and as graphs on CUDA."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import triton

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.layer import set_attn_backend
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.worker.cudagraph import CudaGraphManager, SamplerGraphs, resolve_capture_sizes
from vllm.v1.worker.model_runner import ModelRunner

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 42, 9, 3], [1, 2, 3, 4, 5, 6, 7], [30, 31, 32], [8, 8, 8, 8, 8, 8, 8, 8, 8]]


class _LogitsRecorder:
    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, metadata: Any) -> Any:
        self.logits.append(logits.detach().float().cpu().clone())
        return self.sampler(logits, metadata)


def _runner(device: str, dtype: str = "float32", enforce_eager: bool = True,
            capture_sizes: list[int] | None = None, record: bool = True, **model_kwargs: Any
            ) -> tuple[ModelRunner, _LogitsRecorder]:
    config = VllmConfig(
        model_config=ModelConfig(dtype=dtype, max_model_len=64, enforce_eager=enforce_eager,
                                 cudagraph_capture_sizes=capture_sizes, **model_kwargs),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=False),
        device_config=DeviceConfig(device=device))
    runner = ModelRunner(config)
    runner.initialize_kv_cache(40)
    recorder = _LogitsRecorder(runner.sampler)
    if record:
        runner.sampler = recorder  # type: ignore[assignment]
        # NOTE: the recorder copies to the host, which a captured sampler cannot do.
        runner.sampler_graphs = None
    return runner, recorder


# Sampling masks with their JSON text and processed logprobs, as under `vllm serve --return-sampling-mask`.
MASK_KWARGS = dict(return_sampling_mask=True, sampling_mask_text=True, logprobs_mode="processed_logprobs")


def _count_sampler_graph_runs(runner: ModelRunner, sizes: list[int]) -> list[int]:
    """Give `runner` sampler graphs of `sizes` that run the padded sampler eagerly (SamplerGraphs(capture=False));
    returns the list that every sampler-graph run appends its size to."""
    runner.sampler_graphs = SamplerGraphs(sizes, capture=False)
    calls: list[int] = []
    run = runner.sampler_graphs.run
    runner.sampler_graphs.run = lambda size, key, fn: (calls.append(size), run(size, key, fn))[1]  # type: ignore
    return calls


def _padded_cpu_runner(sizes: list[int]) -> tuple[ModelRunner, list[int]]:
    """A CPU runner with masks whose decode steps are padded to `sizes` as for CUDA graphs, sampling through the
    eager stand-in of the sampler graphs; and the sizes those were run at (_count_sampler_graph_runs)."""
    runner, _ = _runner("cpu", capture_sizes=sizes, record=False, **MASK_KWARGS)
    runner.pad_eager_decode = True
    return runner, _count_sampler_graph_runs(runner, sizes)


def _mask_row(out: Any, j: int) -> list[int]:
    """Row j's sampling mask of a runner output: its ids, or, when the runner copied only the JSON text (the
    default with the text: ids-free lists), its text parsed (of the row's size)."""
    masks = out.sampling_masks
    size = int(masks.offsets[j + 1] - masks.offsets[j])
    if masks.token_ids is not None:
        return masks.token_ids[masks.offsets[j]:masks.offsets[j + 1]].tolist()
    row = json.loads(bytes(out.sampling_mask_text.rows()[j]))
    assert len(row) == size
    return row


def _assert_same_outputs(got: list[Any], want: list[Any], masks: bool = False) -> None:
    """Per step the same requests and tokens; with `masks` also logprobs (ids, values within 1e-5, ranks), masks
    (their ids, or their parsed text when the runners copy no ids: `_mask_row`) and mask text."""
    for g, w in zip(got, want, strict=True):
        assert g.req_ids == w.req_ids and g.sampled_token_ids == w.sampled_token_ids
        if not masks:
            continue
        for j in range(len(g.req_ids)):
            assert g.logprobs.logprob_token_ids[j].tolist() == w.logprobs.logprob_token_ids[j].tolist()
            assert g.logprobs.logprobs[j].tolist() == pytest.approx(w.logprobs.logprobs[j].tolist(), abs=1e-5)
            assert g.logprobs.sampled_token_ranks[j] == w.logprobs.sampled_token_ranks[j]
            assert _mask_row(g, j) == _mask_row(w, j)
        assert bytes(g.sampling_mask_text.text) == bytes(w.sampling_mask_text.text)

def _run_steps(runner: ModelRunner, num_reqs: int, num_decodes: int, params: SamplingParams | None = None,
               outputs: list[Any] | None = None) -> list[list[int]]:
    """Prefill the first num_reqs prompts in one step, then decode num_decodes steps; returns sampled ids
    (and appends each decode step's ModelRunnerOutput to `outputs`)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [f"r{i}" for i in range(num_reqs)]
    # Request i owns blocks 4i..4i+3 (16 tokens).
    blocks = {r: list(range(4 * i, 4 * i + 4)) for i, r in enumerate(ids)}
    # Requests of three API servers (client_index 0, 2, 1, 0, ...): their mask texts are packed by server.
    new = [NewRequestData(r, PROMPTS[i], [], params, blocks[r], 0, client_index=2 * i % 3) for i, r in enumerate(ids)]
    sched = {r: len(PROMPTS[i]) for i, r in enumerate(ids)}
    out = runner.execute_model(SchedulerOutput(new, CachedRequestData(), sched, sum(sched.values()), set()))
    tokens = [list(t) for t in out.sampled_token_ids]
    computed = dict(sched)
    for _ in range(num_decodes):
        # Reverse order each step, so rows and step order differ.
        ids = ids[::-1]
        cached = CachedRequestData(list(ids), [[] for _ in ids], [computed[r] for r in ids])
        out = runner.execute_model(SchedulerOutput([], cached, {r: 1 for r in ids}, len(ids), set()))
        if outputs is not None:
            outputs.append(out)
        for r in ids:
            tokens[int(r[1:])] += out.sampled_token_ids[out.req_id_to_index[r]]
            computed[r] += 1
    return tokens


def test_capture_sizes() -> None:
    assert resolve_capture_sizes(None, 10, 8192) == [1, 2, 4, 8, 10]
    assert resolve_capture_sizes(None, 2048, 300) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300]
    assert resolve_capture_sizes([3, 1, 64], 32, 8192) == [1, 3]
    manager = CudaGraphManager([1, 2, 4, 8])
    assert [manager.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_padded_decode_matches_unpadded(backend: str, num_reqs: int) -> None:
    # NOTE: the knob, not the environment: a test that sets the knob may leave TRITON_INTERPRET="0" behind.
    if backend == "TRITON" and torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        pytest.skip("CPU tensors through Triton need the interpreter; test_graph_replay_matches_eager covers CUDA")
    num_decodes = 2 if backend == "TRITON" else 3
    ref, ref_rec = _runner("cpu")
    padded, pad_rec = _runner("cpu", capture_sizes=[2, 4])
    padded.pad_eager_decode = True
    if backend == "TRITON":
        for runner in (ref, padded):
            runner.attn_backend = TritonAttentionBackend()
            set_attn_backend(runner.model, runner.attn_backend)
        # More splits than the short contexts have key tiles: the empty splits must not change the result.
        padded._graph_num_splits = lambda num_rows: 4  # type: ignore[method-assign]
    seen_pads: list[int | None] = []
    prepare = padded.input_buffers.prepare
    padded.input_buffers.prepare = lambda *a, **k: (seen_pads.append(a[2]), prepare(*a, **k))[1]  # type: ignore
    assert _run_steps(padded, num_reqs, num_decodes) == _run_steps(ref, num_reqs, num_decodes)
    assert seen_pads == [None] + [2 if num_reqs == 1 else 4] * num_decodes
    for a, b in zip(pad_rec.logits, ref_rec.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_reqs", [1, 3, 4])
def test_graph_replay_matches_eager(num_reqs: int) -> None:
    eager, eager_rec = _runner("cuda", enforce_eager=True)
    graphs, graph_rec = _runner("cuda", enforce_eager=False, capture_sizes=[1, 2, 4, 8])
    graphs.capture_model()
    assert sorted(graphs.cudagraphs.graphs) == [1, 2, 4, 8]
    replays: list[int] = []
    replay = graphs.cudagraphs.replay
    graphs.cudagraphs.replay = lambda size: (replays.append(size), replay(size))[1]  # type: ignore
    assert _run_steps(graphs, num_reqs, 4) == _run_steps(eager, num_reqs, 4)
    assert replays == [graphs.cudagraphs.padded_size(num_reqs)] * 4
    for a, b in zip(graph_rec.logits, eager_rec.logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _per_request(outputs: list[Any], num_reqs: int) -> list[list[tuple[Any, ...]]]:
    """Each decode step's (token, logprob ids, logprob values, rank, mask ids) per request id r0..r{n-1}; when the
    step carries the masks' JSON text, every row's text must be its ids as JSON, and the texts of each API server's
    requests (client_index 2 * i % 3, see _run_steps) one contiguous span, servers in order."""
    steps = []
    for out in outputs:
        lp, masks, texts = out.logprobs, out.sampling_masks, out.sampling_mask_text
        if texts is not None:
            assert len(texts.offsets) == len(out.req_ids) + 1
            rows = texts.rows()
            packed = [int(texts.packed_rows(out.req_id_to_index[f"r{i}"])) for i in range(num_reqs)]
            by_client = [sorted(k for i, k in enumerate(packed) if 2 * i % 3 == c) for c in range(3)]
            assert sum(by_client, []) == list(range(num_reqs)), by_client
        row = []
        for i in range(num_reqs):
            j = out.req_id_to_index[f"r{i}"]
            mask = _mask_row(out, j) if masks is not None else None
            if texts is not None and masks.token_ids is not None:
                assert bytes(rows[j]) == json.dumps(mask, separators=(",", ":")).encode()
            row.append((out.sampled_token_ids[j], lp.logprob_token_ids[j].tolist(), lp.logprobs[j].tolist(),
                        int(lp.sampled_token_ranks[j]), mask))
        steps.append(row)
    return steps


# top_k=1: the draw cannot matter, so tokens, logprobs and masks must match exactly at every step. top_k=4
# with top_p: the padded sampler draws random numbers for more rows, so the tokens (and with them the later
# steps' contexts) may differ: the first decode step's masks and top logprobs are compared, and every step's
# token must lie in its mask.
@pytest.mark.parametrize("copy_ids", ["0", "1"], ids=["text_only", "ids"])
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (4, 0.9)])
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_padded_sampler_matches_unpadded(num_reqs: int, top_k: int, top_p: float, copy_ids: str) -> None:
    # NOTE: with the ids copied too (as for a vocabulary whose ids the device does not format: mask_ids_needed)
    # every text is also checked against its ids.
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, logprobs=1, max_tokens=16, ignore_eos=True)
    ref, _ = _runner("cpu", record=False, **MASK_KWARGS)
    padded, calls = _padded_cpu_runner([2, 4])
    for runner in (ref, padded):
        runner.output_copier.mask_ids = copy_ids == "1"
    # NOTE: the prefill step samples unpadded, as the reference's does (the padded sampler of steps with prefills
    # draws for more rows, so with top_p the first decode step's context could differ; its own tests are below).
    padded.sample_mixed_graphed = False
    got: list[Any] = []
    want: list[Any] = []
    _run_steps(padded, num_reqs, 3, params, got)
    _run_steps(ref, num_reqs, 3, params, want)
    assert calls == [2 if num_reqs == 1 else 4] * 3
    for step, (got_step, want_step) in enumerate(zip(_per_request(got, num_reqs), _per_request(want, num_reqs))):
        for (tok, lp_ids, lp_vals, rank, mask), (w_tok, w_lp_ids, w_lp_vals, w_rank, w_mask) in zip(got_step,
                                                                                                 want_step):
            assert 1 <= len(mask) <= top_k and tok[0] in mask and lp_ids[0] == tok[0] and 1 <= rank <= len(mask)
            if step == 0 or top_k == 1:
                assert mask == w_mask and lp_ids[1] == w_lp_ids[1]
                assert lp_vals[1] == pytest.approx(w_lp_vals[1], abs=1e-5)
            if top_k == 1:
                assert (tok, lp_ids, rank) == (w_tok, w_lp_ids, w_rank)
                assert lp_vals == pytest.approx(w_lp_vals, abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (4, 0.9)])
def test_sampler_graph_matches_eager(top_k: int, top_p: float) -> None:
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, logprobs=1, max_tokens=16, ignore_eos=True)
    eager, _ = _runner("cuda", enforce_eager=False, capture_sizes=[1, 2, 4, 8], record=False, **MASK_KWARGS)
    graphs, _ = _runner("cuda", enforce_eager=False, capture_sizes=[1, 2, 4, 8], record=False, **MASK_KWARGS)
    eager.sampler_graphs = None
    # NOTE: the prefill step samples eagerly in both runners (see test_padded_sampler_matches_unpadded); the
    # sampler graphs of steps with prefills have their own test below.
    graphs.sample_mixed_graphed = False
    for runner in (eager, graphs):
        runner.capture_model()
    assert graphs.sampler_graphs is not None
    got: list[Any] = []
    want: list[Any] = []
    _run_steps(graphs, 3, 4, params, got)
    _run_steps(eager, 3, 4, params, want)
    # Two sets of graphs, used alternately, every size captured at the key's first step.
    assert sorted((s, size) for s, size, _ in graphs.sampler_graphs.graphs) == [(s, b) for s in (0, 1)
                                                                                  for b in (1, 2, 4, 8)]
    for step, (got_step, want_step) in enumerate(zip(_per_request(got, 3), _per_request(want, 3))):
        for (tok, lp_ids, lp_vals, rank, mask), (w_tok, w_lp_ids, _, _, w_mask) in zip(got_step, want_step):
            assert 1 <= len(mask) <= top_k and tok[0] in mask
            if step == 0 or top_k == 1:
                assert mask == w_mask and lp_ids[1] == w_lp_ids[1]
            if top_k == 1:
                assert tok == w_tok


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_text_only_mask_copy_gives_the_same_texts(device: str) -> None:
    """The default with the text (no ids copied): the sampler graphs (CUDA; on CPU their padded eager stand-in) prepack no ids
    and the copier copies none; the steps' lists carry each row's size and no ids, and the texts equal those of a
    runner that copies the ids, step by step (the same seeded draws), each one its row's ids as JSON."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, logprobs=1, max_tokens=16, ignore_eos=True)
    steps: dict[str, list[Any]] = {}
    for mode in ("1", "0"):
        if device == "cpu":
            runner, calls = _padded_cpu_runner([2, 4])
        else:
            runner, _ = _runner("cuda", enforce_eager=False, capture_sizes=[1, 2, 4], record=False, **MASK_KWARGS)
        assert not runner.output_copier.mask_ids  # the default with the text
        runner.output_copier.mask_ids = mode == "1"  # the ids copied too, as for mask_ids_needed's vocabularies
        if device == "cuda":
            runner.capture_model()
        assert runner.output_copier.mask_ids is (mode == "1")
        torch.manual_seed(1234)
        steps[mode] = []
        _run_steps(runner, 3, 3, params, steps[mode])
        if device == "cpu":
            assert calls == [4] * 4  # the prefill step and three decode steps through the padded sampler
    _per_request(steps["1"], 3)  # every text is its row's ids as JSON
    for got, want in zip(steps["0"], steps["1"], strict=True):
        assert got.req_ids == want.req_ids and got.sampled_token_ids == want.sampled_token_ids
        assert got.sampling_masks.token_ids is None
        assert got.sampling_masks.offsets.tolist() == want.sampling_masks.offsets.tolist()
        assert [bytes(t) for t in got.sampling_mask_text.rows()] == [bytes(t) for t in want.sampling_mask_text.rows()]


def test_sampler_graphs_bookkeeping_without_capture() -> None:
    """SamplerGraphs' decisions that need no GPU: capture=False runs the function of the asked size eagerly; a
    key that failed to capture (or one past max_keys) makes run() return None so the runner samples eagerly."""
    eager = SamplerGraphs([2, 4], capture=False)
    assert eager.run(4, "k", lambda size: (lambda: ("out", size))) == ("out", 4)
    graphs = SamplerGraphs.__new__(SamplerGraphs)
    graphs.__dict__.update(sizes=[2, 4], capture=True, max_keys=1, graphs={}, keys={"old"}, pools=[], failed=False,
                           _next_set=0)
    assert graphs.run(4, "new", lambda size: (lambda: None)) is None  # past max_keys
    graphs.max_keys, graphs.failed = 8, True
    assert graphs.run(4, "new", lambda size: (lambda: None)) is None  # after a failed capture
    graphs.failed = False
    assert graphs.run(3, "new", lambda size: (lambda: None)) is None  # not a capture size


# ---- Mixed steps padded to a fixed shape (tokens and request rows) -------------------------------------------

# Eight requests; each owns 5 blocks (20 tokens) of the 40, the scratch block is 40.
MIXED_PROMPTS = [[5, 17, 42, 9, 3], [1, 2, 3, 4, 5, 6, 7], [30, 31, 32], [8, 8, 8, 8, 8, 8, 8, 8, 8],
                 [11, 12, 13, 14, 15, 16], [40, 41, 42, 43], [50, 51, 52, 53, 54, 55, 56, 57], [60, 61]]
# Scheduled tokens per request and step; a request's first appearance is its new-request step. Step 0: r1 is a
# partial prefill (4 of 7, no sample); step 2: 12 tokens, exactly the mixed size 12 (no padding tokens); step 3:
# all 8 requests (max_num_seqs), so the padding request takes the one spare row; r6 is partial (2 of 8); step 4
# is a pure decode step; step 5 finishes r6's prompt among decodes.
MIXED_STEPS = [{"r0": 5, "r1": 4}, {"r0": 1, "r1": 3, "r2": 3}, {"r2": 1, "r0": 1, "r1": 1, "r3": 9},
               {"r3": 1, "r4": 6, "r0": 1, "r5": 4, "r1": 1, "r6": 2, "r2": 1, "r7": 2},
               {"r7": 1, "r5": 1, "r4": 1, "r3": 1, "r2": 1, "r1": 1, "r0": 1},
               {"r0": 1, "r6": 6, "r1": 1, "r2": 1, "r3": 1, "r4": 1, "r5": 1, "r7": 1}]
MIXED_SIZES = [12, 16, 32]
# The size each step is padded to: 9 -> 12, 7 -> 12, 12 -> 12, 18 -> 32, decode (not padded as mixed), 13 -> 16.
MIXED_PADS = [12, 12, 12, 32, None, 16]


def _run_mixed_steps(runner: ModelRunner, params: SamplingParams, steps: list[dict[str, int]] = MIXED_STEPS
                     ) -> list[Any]:
    """Run `steps` (scheduled tokens per request id r<i>); returns each step's ModelRunnerOutput."""
    computed: dict[str, int] = {}
    outputs = []
    for sched in steps:
        new = [NewRequestData(r, MIXED_PROMPTS[int(r[1:])], [], params,
                              list(range(5 * int(r[1:]), 5 * int(r[1:]) + 5)), 0) for r in sched if r not in computed]
        old = [r for r in sched if r in computed]
        cached = CachedRequestData(old, [[] for _ in old], [computed[r] for r in old])
        outputs.append(runner.execute_model(SchedulerOutput(new, cached, dict(sched), sum(sched.values()), set())))
        for r, n in sched.items():
            computed[r] = computed.get(r, 0) + n
    return outputs


def _mixed_runners(backend: str, **kwargs: Any) -> tuple[ModelRunner, ModelRunner, list[int | None]]:
    """An unpadded runner and one that pads mixed steps to MIXED_SIZES (and decode steps as for graphs); the
    list collects the pad_tokens of the padded runner's steps."""
    ref, _ = _runner("cpu", **kwargs)
    padded, _ = _runner("cpu", capture_sizes=[2, 4, 8], **kwargs)
    padded.pad_eager_mixed = True
    padded.pad_eager_decode = True
    padded.mixed_graphs = CudaGraphManager(MIXED_SIZES, kind="mixed")
    if backend == "TRITON":
        for runner in (ref, padded):
            runner.attn_backend = TritonAttentionBackend()
            set_attn_backend(runner.model, runner.attn_backend)
    seen: list[int | None] = []
    prepare = padded.input_buffers.prepare
    padded.input_buffers.prepare = lambda *a, **k: (seen.append(a[4]), prepare(*a, **k))[1]  # type: ignore
    return ref, padded, seen


def _skip_triton_on_cuda(backend: str) -> None:
    if backend == "TRITON" and torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        pytest.skip("CPU tensors through Triton need the interpreter")


def test_mixed_capture_sizes() -> None:
    from vllm.v1.worker.cudagraph import resolve_mixed_capture_sizes
    assert resolve_mixed_capture_sizes(None, 1024, 4096) == [256, 512, 768, 1024]
    assert resolve_mixed_capture_sizes(None, 600, 4096) == [256, 512, 600]
    assert resolve_mixed_capture_sizes(None, 64, 4096) == [64]
    # Gaps wider than max_model_len get sizes inside them, so one padding request always holds the padding.
    assert resolve_mixed_capture_sizes(None, 512, 100) == [100, 200, 256, 356, 456, 512]
    assert resolve_mixed_capture_sizes([48, 8, 1000], 64, 20) == [8, 28, 48]
    # At most max_num_seqs requests of max_model_len tokens: the budget is capped there.
    assert resolve_mixed_capture_sizes(None, 8192, 512, 4) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert resolve_mixed_capture_sizes(None, 1024, 100, 3) == [100, 200, 256, 300]


@pytest.mark.parametrize("max_num_seqs,max_model_len,budget", [(4, 512, 8192), (1, 64, 8192), (3, 100, 1024),
                                                                (8, 64, 64), (2, 2048, 8192), (16, 48, 1000)])
def test_every_mixed_size_can_be_captured(max_num_seqs: int, max_model_len: int, budget: int) -> None:
    """The capture fills every mixed size with padding requests only (max_num_seqs + 1 rows of at most
    max_model_len tokens): that must fit for every resolved size, also when max_num_seqs * max_model_len is below
    the token budget (a small server: without the cap the largest size did not fit and start-up failed)."""
    from vllm.v1.worker.cudagraph import resolve_mixed_capture_sizes
    from vllm.v1.worker.input_prep import InputBuffers
    sizes = resolve_mixed_capture_sizes(None, budget, max_model_len, max_num_seqs)
    assert sizes and sizes[-1] == min(budget, max_num_seqs * max_model_len)
    buffers = InputBuffers(max_num_reqs=max_num_seqs, max_num_tokens=budget, max_model_len=max_model_len,
                           max_num_blocks_per_req=-(-max_model_len // BLOCK_SIZE), block_size=BLOCK_SIZE,
                           scratch_block=40, device=torch.device("cpu"))
    for size in sizes:
        buffers.fill_dummy_mixed(size, buffers.max_num_rows)


def test_runner_caps_mixed_sizes_at_its_requests() -> None:
    """The model runner resolves its mixed sizes with its max_num_seqs (8 requests of 64 tokens here: 512, not
    the 1024-token budget)."""
    config = VllmConfig(model_config=ModelConfig(dtype="float32", max_model_len=64),
                        cache_config=CacheConfig(block_size=BLOCK_SIZE),
                        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
                        device_config=DeviceConfig(device="cpu"))
    assert ModelRunner(config).mixed_graphs.capture_sizes == [64, 128, 192, 256, 320, 384, 448, 512]


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_padded_mixed_steps_match_unpadded(backend: str) -> None:
    """Every step's logits and tokens equal the unpadded runner's, and the KV cache of the requests' blocks after
    six steps too: the padding requests write only the scratch block."""
    _skip_triton_on_cuda(backend)
    ref, padded, seen = _mixed_runners(backend)
    recorders = [ref.sampler, padded.sampler]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    shapes: list[tuple[int, int, int]] = []
    forward = padded._forward_rows

    def record_shape(inputs: Any) -> torch.Tensor:
        md = inputs.attn_metadata
        shapes.append((md.num_actual_tokens, md.num_reqs, md.max_query_len))
        return forward(inputs)

    padded._forward_rows = record_shape  # type: ignore[method-assign]
    got, want = _run_mixed_steps(padded, params), _run_mixed_steps(ref, params)
    assert seen == MIXED_PADS
    # Mixed steps: T tokens, max_num_seqs + 1 rows, max_query_len = T; the decode step is padded to 8 rows.
    assert shapes == [(12, 9, 12), (12, 9, 12), (12, 9, 12), (32, 9, 32), (8, 8, 1), (16, 9, 16)]
    for g, w in zip(got, want):
        assert g.req_ids == w.req_ids and g.sampled_token_ids == w.sampled_token_ids
    assert [len(o.sampled_token_ids[o.req_id_to_index["r1"]]) for o in got[:2]] == [0, 1]  # partial, then done
    want_logits, got_logits = recorders[0].logits, recorders[1].logits  # type: ignore[union-attr]
    assert len(got_logits) == len(want_logits) == len(MIXED_STEPS)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for cache_pad, cache_ref in zip(padded.kv_caches, ref.kv_caches):
        torch.testing.assert_close(cache_pad[:, :40], cache_ref[:, :40], rtol=1e-5, atol=1e-5)
        assert cache_pad[:, 40].abs().sum() > 0 and cache_ref[:, 40].abs().sum() == 0


@pytest.mark.parametrize("sampler_graph", [False, True])
@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_padded_mixed_sampler_matches_unpadded(backend: str, sampler_graph: bool) -> None:
    """top_k=1 with logprobs and sampling masks: tokens, logprobs, ranks and masks per request equal; with
    `sampler_graph` the padded mixed steps also sample as the padded sampler (sample_mixed_graphed)."""
    _skip_triton_on_cuda(backend)
    ref, padded, seen = _mixed_runners(backend, record=False, **MASK_KWARGS)
    calls: list[int] = []
    if sampler_graph:
        padded.sample_mixed_graphed = True
        calls = _count_sampler_graph_runs(padded, [2, 4, 8])
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=2, max_tokens=16, ignore_eos=True)
    got, want = _run_mixed_steps(padded, params), _run_mixed_steps(ref, params)
    assert seen == MIXED_PADS
    _assert_same_outputs(got, want, masks=True)
    # Every step through the padded sampler: the request counts 2, 3, 4, 8, 7, 8 padded to the capture sizes.
    assert calls == ([2, 4, 4, 8, 8, 8] if sampler_graph else [])


def test_padded_mixed_step_too_large_runs_unpadded() -> None:
    """A mixed step larger than every mixed size runs unpadded (and still matches)."""
    ref, padded, seen = _mixed_runners("TORCH")
    padded.mixed_graphs = CudaGraphManager([8], kind="mixed")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got, want = _run_mixed_steps(padded, params), _run_mixed_steps(ref, params)
    assert seen == [None, 8, None, None, None, None]
    assert [o.sampled_token_ids for o in got] == [o.sampled_token_ids for o in want]


def _prefill_steps(runner: ModelRunner, params: SamplingParams) -> list[Any]:
    """Three steps of three requests: prefills with a partial chunk (r1: 3 of its 7 prompt tokens, so it does not
    sample), then r1's rest among two decodes, then a pure decode step; each step's ModelRunnerOutput."""
    blocks = {f"r{i}": list(range(4 * i, 4 * i + 4)) for i in range(3)}
    new = [NewRequestData(f"r{i}", PROMPTS[i], [], params, blocks[f"r{i}"], 0, client_index=i) for i in range(3)]
    sched = {"r0": 5, "r1": 3, "r2": 3}
    outs = [runner.execute_model(SchedulerOutput(new, CachedRequestData(), sched, 11, set()))]
    ids = ["r2", "r1", "r0"]
    cached = CachedRequestData(list(ids), [[] for _ in ids], [3, 3, 5])
    outs.append(runner.execute_model(SchedulerOutput([], cached, {"r2": 1, "r1": 4, "r0": 1}, 6, set())))
    cached = CachedRequestData(list(ids), [[] for _ in ids], [4, 7, 6])
    outs.append(runner.execute_model(SchedulerOutput([], cached, {r: 1 for r in ids}, 3, set())))
    return outs


def test_padded_sampler_of_prefill_steps_matches_unpadded() -> None:
    """Sampler graphs of steps with prefills on CPU (the sampler graph's padded sampler, run eagerly): steps with prefills
    sample as the padded sampler of their request count over their requests' last hidden states, and give the
    unpadded sampler's tokens, logprobs and masks (top_k=1: exact); the partial chunk samples nothing."""
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=1, max_tokens=16, ignore_eos=True)
    ref, _ = _runner("cpu", record=False, **MASK_KWARGS)
    padded, calls = _padded_cpu_runner([2, 4])
    padded.sample_mixed_graphed = True
    got, want = _prefill_steps(padded, params), _prefill_steps(ref, params)
    assert calls == [4, 4, 4]
    for g, w in zip(got, want):
        by_id = {r: g.sampled_token_ids[g.req_id_to_index[r]] for r in g.req_ids}
        assert by_id == {r: w.sampled_token_ids[w.req_id_to_index[r]] for r in w.req_ids}
    assert got[0].sampled_token_ids[got[0].req_id_to_index["r1"]] == []  # the partial chunk
    # Tokens, logprobs and masks of every sampling request, per step (the partial chunk's row is empty).
    _assert_same_sampled(got, want)


def test_step_without_sampling_rows_samples_eagerly() -> None:
    """A step of partial prompt chunks only (nothing samples) does not go through the sampler graphs (its settings,
    without mask rows, would be a graph key of their own); the step that finishes the prompt does, and its token
    and mask equal the unpadded runner's."""
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=1, max_tokens=16, ignore_eos=True)
    ref, _ = _runner("cpu", record=False, **MASK_KWARGS)
    padded, calls = _padded_cpu_runner([2, 4])
    outs = []
    for runner in (padded, ref):
        new = [NewRequestData("r1", PROMPTS[1], [], params, [0, 1, 2, 3], 0, client_index=0)]
        first = runner.execute_model(SchedulerOutput(new, CachedRequestData(), {"r1": 3}, 3, set()))
        cached = CachedRequestData(["r1"], [[]], [3])
        outs.append((first, runner.execute_model(SchedulerOutput([], cached, {"r1": 4}, 4, set()))))
    assert calls == [2]  # only the step that finishes the prompt
    (p_first, p_second), (r_first, r_second) = outs
    assert p_first.sampled_token_ids == r_first.sampled_token_ids == [[]]
    _assert_same_sampled([p_second], [r_second])


def test_padded_sampler_of_prefill_steps_top_p_masks() -> None:
    """Sampler graphs of steps with prefills with top_k=4, top_p=0.9 (the setting RL rollouts use): the first step's masks and
    top logprobs depend on the logits only, not on the draw, so they equal the unpadded sampler's; every sampled
    token lies in its mask. (The draws differ: the padded sampler draws for the padding rows too.)"""
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, logprobs=1, max_tokens=16, ignore_eos=True)
    ref, _ = _runner("cpu", record=False, **MASK_KWARGS)
    padded, calls = _padded_cpu_runner([2, 4])
    assert padded.sample_mixed_graphed  # the default
    got, want = _prefill_steps(padded, params), _prefill_steps(ref, params)
    assert calls == [4, 4, 4]
    g, w = got[0], want[0]
    assert sorted(g.req_ids) == sorted(w.req_ids)
    for r in g.req_ids:
        j, k = g.req_id_to_index[r], w.req_id_to_index[r]
        mask = _mask_row(g, j)
        assert mask == _mask_row(w, k)
        if r == "r1":  # the partial chunk
            assert mask == [] and g.sampled_token_ids[j] == []
            continue
        assert 1 <= len(mask) <= 4 and g.sampled_token_ids[j][0] in mask
        assert g.logprobs.logprob_token_ids[j].tolist()[1] == w.logprobs.logprob_token_ids[k].tolist()[1]
        assert g.logprobs.logprobs[j].tolist()[1] == pytest.approx(w.logprobs.logprobs[k].tolist()[1], abs=1e-5)
    for out in got:
        for r in out.req_ids:
            j = out.req_id_to_index[r]
            if out.sampled_token_ids[j]:
                assert out.sampled_token_ids[j][0] in _mask_row(out, j)


def _assert_same_sampled(got: list[Any], want: list[Any]) -> None:
    """Per step, the same requests sampled the same tokens, logprob ids and masks, with logprobs within 1e-4."""
    for g_step, w_step in zip(_per_request_sampled(got), _per_request_sampled(want), strict=True):
        assert g_step.keys() == w_step.keys()
        for r, (tok, lp_ids, mask, lp_vals) in g_step.items():
            assert (tok, lp_ids, mask) == w_step[r][:3]
            assert lp_vals == pytest.approx(w_step[r][3], abs=1e-4)


def _per_request_sampled(outputs: list[Any]) -> list[dict[str, tuple[Any, ...]]]:
    """Each step's (token, logprob ids, mask, logprob values) per request that sampled."""
    steps = []
    for out in outputs:
        lp, masks = out.logprobs, out.sampling_masks
        row: dict[str, tuple[Any, ...]] = {}
        for r in out.req_ids:
            j = out.req_id_to_index[r]
            if not out.sampled_token_ids[j]:
                assert masks.offsets[j + 1] == masks.offsets[j]
                continue
            mask = _mask_row(out, j)
            assert mask == out.sampled_token_ids[j]  # top_k=1
            row[r] = (out.sampled_token_ids[j], lp.logprob_token_ids[j].tolist(), mask, lp.logprobs[j].tolist())
        steps.append(row)
    return steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_sampler_graph_of_prefill_steps_matches_eager() -> None:
    """Sampler graphs of steps with prefills on CUDA: the prefill steps' last hidden states go into the decode graph's static
    output and the captured sampler graph of the padded size runs over them; tokens, logprobs and masks equal
    the eager runner's (top_k=1: exact)."""
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=1, max_tokens=16, ignore_eos=True)
    eager, _ = _runner("cuda", enforce_eager=True, record=False, **MASK_KWARGS)
    graphs, _ = _runner("cuda", enforce_eager=False, capture_sizes=[1, 2, 4, 8], record=False, **MASK_KWARGS)
    graphs.sample_mixed_graphed = True
    graphs.capture_model()
    assert graphs.sampler_graphs is not None
    replayed: list[int] = []
    run = graphs.sampler_graphs.run
    graphs.sampler_graphs.run = lambda size, key, fn: (  # type: ignore[method-assign]
        lambda out: (replayed.append(size if out is not None else -1), out)[1])(run(size, key, fn))
    got, want = _prefill_steps(graphs, params), _prefill_steps(eager, params)
    assert replayed == [4, 4, 4]
    _assert_same_sampled(got, want)
