"""Sleep mode on CUDA (skipped without a GPU): the memory really goes back to the device, comes back at the same
addresses, and the captured CUDA graphs replay correctly after a wake (no re-capture).

References: torch.cuda.mem_get_info (the driver's free memory) before and after; a region's contents written
before a release and rewritten after; the engine's own outputs before sleeping (greedy and seeded, with masks)
and a fresh engine on the checkpoint loaded while asleep."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from rl_checkpoints import perturbed_weights, write_checkpoint  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 300, 12]}, {"prompt_token_ids": [7, 8, 9]},
           {"prompt_token_ids": list(range(40, 90))}]
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True,
                        return_sampling_mask=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, return_sampling_mask=False)
GIB = 1 << 30


def _outputs(llm: LLM) -> list:
    out = []
    for params in (GREEDY, SEEDED):
        for r in llm.generate(PROMPTS, params, use_tqdm=False):
            mask = r.outputs[0].sampling_mask
            out.append((r.outputs[0].token_ids, None if mask is None else mask.token_ids))
    return out


def _worker(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.worker


def _graphs(runner) -> dict:
    """Every captured graph object, by kind and size (the same objects must serve after a wake)."""
    found = {("decode", s): id(g) for s, g in runner.cudagraphs.graphs.items()}
    found.update({("mixed", s): id(g) for s, g in runner.mixed_graphs.graphs.items()})
    return found


def test_region_keeps_its_address_and_a_graph_over_it_replays_after_restore() -> None:
    from vllm.device_allocator.cumem import CudaRegion
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = 2 * GIB
    region = CudaRegion(nbytes, device)
    x = region.flat[:1 << 20].view(torch.float32)  # [262144]
    y = torch.empty_like(x)
    x.copy_(torch.arange(x.numel(), dtype=torch.float32, device=device))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y.copy_(x * 2)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(x * 2)
    ptr = region.flat.data_ptr()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(device)[0]
    region.release()
    free_asleep = torch.cuda.mem_get_info(device)[0]
    assert free_asleep - free_before >= nbytes - (64 << 20)
    region.restore()
    assert torch.cuda.mem_get_info(device)[0] <= free_before + (64 << 20)
    assert region.flat.data_ptr() == ptr
    x.copy_(torch.full_like(x, 3.0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 6.0))
    region.release()
    region.release()  # twice: harmless
    region.restore()
    region.restore()


def test_pinned_host_buffer_is_exact_pinned_and_round_trips() -> None:
    """Sleep mode's host backup: page-locked (torch sees it pinned), exactly the size asked (not a power of two),
    and an asynchronous copy there and back gives the bytes written."""
    from vllm.device_allocator.cumem import pinned_host_buffer
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = (3 << 20) + 12345
    host = pinned_host_buffer(nbytes, device)
    assert host.device.type == "cpu" and host.dtype == torch.uint8 and host.numel() == nbytes
    assert host.is_pinned()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    assert torch.equal(back, src) and torch.equal(host, src.cpu())


def test_sleep_frees_memory_and_wake_replays_the_same_graphs(tmp_path: Path) -> None:
    llm = LLM(enable_sleep_mode=True, gpu_memory_utilization=0.5, max_model_len=512, max_num_seqs=16,
              return_sampling_mask=True, logprobs_mode="processed_logprobs", weight_transfer_config={"backend": "disk"})
    worker = _worker(llm)
    runner = worker.model_runner
    assert runner.use_cuda_graph and runner.cudagraphs.graphs
    before = _outputs(llm)
    graphs = _graphs(runner)
    params = {n: p.data_ptr() for n, p in runner.model.named_parameters()}
    kv = [t.data_ptr() for t in runner.kv_caches]
    held = worker.sleeper.weights.nbytes + worker.sleeper.kv_cache.nbytes
    device = worker.device
    # The weights' pinned host backup exists from start-up; sleeps copy into it and never replace it.
    backup = worker.sleeper.host_backup
    assert backup.is_pinned() and backup.numel() == worker.sleeper.weight_bytes
    backup_ptr = backup.data_ptr()

    torch.cuda.synchronize(device)
    free_awake = torch.cuda.mem_get_info(device)[0]
    llm.sleep(level=1)
    free_asleep = torch.cuda.mem_get_info(device)[0]
    assert llm.is_sleeping()
    assert free_asleep - free_awake >= 0.95 * held, (free_awake, free_asleep, held)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert {n: p.data_ptr() for n, p in runner.model.named_parameters()} == params
    assert [t.data_ptr() for t in runner.kv_caches] == kv
    assert _outputs(llm) == before
    assert _graphs(runner) == graphs  # the same graph objects: nothing was re-captured
    assert worker.sleeper.host_backup.data_ptr() == backup_ptr

    # Level 2: weights discarded, a checkpoint loaded while the KV cache still sleeps, then the cache.
    ckpt = write_checkpoint(tmp_path / "new", perturbed_weights())
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.start_weight_update()
    llm.update_weights({"path": str(ckpt)})
    llm.finish_weight_update("v2")
    llm.wake_up(tags=["kv_cache"])
    after_update = _outputs(llm)
    assert _graphs(runner) == graphs
    del llm, worker, runner
    torch.cuda.empty_cache()
    fresh = LLM(str(ckpt), gpu_memory_utilization=0.5, max_model_len=512, max_num_seqs=16,
                return_sampling_mask=True, logprobs_mode="processed_logprobs")
    assert after_update == _outputs(fresh)
