"""Weight transfer: a trainer process sends, a worker's receiver yields bit-equal tensors; bad input is refused.

The two-process tests run the nccl backend over gloo on CPU (NCCL when two GPUs are present); the trainer
holds its own default process group meanwhile. References: tensors built in the test process from the same
seed, compared byte for byte; safetensors files written with safetensors.torch.save_file.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer import make_weight_transfer_engine, update_info_from_tensors
from vllm.distributed.weight_transfer.base import dtype_name
from vllm.distributed.weight_transfer.disk_engine import DiskWeightTransferEngine
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.distributed.weight_transfer.packed_tensor import ALIGN, plan_batches

JOIN_TIMEOUT_S = 60
BUFFER = 4096  # bytes: smaller than the largest test tensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Several dtypes, odd shapes, a 0-dim and an empty tensor, one non-contiguous, one > BUFFER bytes."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(37, 11, generator=g).to(torch.bfloat16)),
        ("layers.0.q.weight", torch.randn(64, 33, generator=g)),  # 8448 bytes > BUFFER
        ("layers.0.q.bias", torch.randn(33, generator=g).to(torch.float16)),
        ("layers.0.step", torch.randint(-2**62, 2**62, (), generator=g)),
        ("layers.0.empty", torch.empty(0, 5, dtype=torch.bfloat16)),
        ("layers.0.ids", torch.randint(-2**62, 2**62, (3, 5, 7), generator=g)),
        ("layers.0.k.weight", torch.randn(9, 13, generator=g).t()),  # non-contiguous
        ("layers.0.mask", torch.rand(17, generator=g) > 0.5),
        ("layers.1.v.weight", torch.randn(5, 3, 1, generator=g).to(torch.float16)),
        ("lm_head.weight", torch.randn(40, 25, generator=g).to(torch.bfloat16)),  # 2000 bytes
    ]


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# (seed, update_info options, tensors the receiver takes before closing its iterator or None for all)
SCENARIOS = [
    (1, {"packed": True, "packed_buffer_size_bytes": BUFFER, "packed_num_buffers": 3}, None),
    (2, {"packed": False}, None),
    # stops early, with batches not yet posted: closing must drain them (else the next scenarios fail)
    (3, {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 2}, 2),
    (4, {"packed": True}, None),  # vLLM's defaults: one 1 GiB buffer holds everything
    (5, {"packed": True, "packed_buffer_size_bytes": 1, "packed_num_buffers": 2}, None),  # all oversized
]
# the trainer's own pipelining depth: it need not match the workers' (only the buffer size sets the layout)
TRAINER_OVERRIDES = {1: {"packed_num_buffers": 2}, 3: {"packed_num_buffers": 3}}


def _trainer(master_port: int, default_port: int, device: str, updates: mp.Queue, results: mp.Queue) -> None:
    import torch.distributed as dist
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1)
        group = NCCLWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": master_port, "world_size": 2, "timeout_s": 20,
             "device": device})
        for seed, options, _ in SCENARIOS:
            tensors = [(n, t.to(device)) for n, t in _make_tensors(seed)]
            updates.put(update_info_from_tensors(tensors, **options))
            args = {"group": group, **options, **TRAINER_OVERRIDES.get(seed, {})}
            NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), args)
        total = torch.ones(1)
        dist.all_reduce(total)  # the default group still works after the transfers
        results.put(("trainer", dist.is_initialized(), dist.get_world_size(), total.item()))
        group.destroy()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        results.put(("trainer-error", repr(e)))
        raise


def _worker(master_port: int, device: str, updates: mp.Queue, results: mp.Queue) -> None:
    import torch.distributed as dist
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        engine = make_weight_transfer_engine(WeightTransferConfig("nccl"), device, rank=0)
        engine.init_transfer_engine(
            {"master_address": "127.0.0.1", "master_port": master_port, "rank_offset": 1, "world_size": 2})
        received = []
        for _, _, stop_after in SCENARIOS:
            info = engine.parse_update_info(updates.get(timeout=JOIN_TIMEOUT_S))
            got = []
            weights = engine.receive_weights(info)
            for name, tensor in weights:
                assert tensor.device == torch.device(device)
                got.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), _as_bytes(tensor)))
                if stop_after is not None and len(got) == stop_after:
                    weights.close()  # must still drain the rest of the trainer's broadcasts
                    break
            received.append(got)
        results.put(("worker", dist.is_initialized(), received))
        engine.shutdown()
    except BaseException as e:  # noqa: BLE001
        results.put(("worker-error", repr(e)))
        raise


def _run_pair(targets: list[tuple], results: mp.Queue) -> dict[str, tuple]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=args) for fn, args in targets]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            item = results.get(timeout=JOIN_TIMEOUT_S)
            assert not item[0].endswith("-error"), item
            out[item[0]] = item[1:]
    except BaseException:
        for p in procs:  # a failed side leaves the other blocked in a collective: end both now
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.parametrize("device", DEVICES)
def test_two_process_transfer_bit_exact(device: str) -> None:
    ctx = mp.get_context("spawn")
    updates, results = ctx.Queue(), ctx.Queue()
    port = _free_port()
    trainer_device, worker_device = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    out = _run_pair([(_trainer, (port, _free_port(), trainer_device, updates, results)),
                     (_worker, (port, worker_device, updates, results))], results)

    default_initialised, default_world_size, all_reduced = out["trainer"]
    assert default_initialised and default_world_size == 1 and all_reduced == 1.0
    worker_default_initialised, received = out["worker"]
    assert not worker_default_initialised  # the worker never built a default process group
    assert len(received) == len(SCENARIOS)
    for (seed, _, stop_after), got in zip(SCENARIOS, received):
        expected = _make_tensors(seed)[:stop_after]
        assert [g[0] for g in got] == [n for n, _ in expected]
        for (name, dtype, shape, data), (_, ref) in zip(got, expected):
            assert (dtype, shape) == (dtype_name(ref.dtype), tuple(ref.shape)), name
            assert data == _as_bytes(ref), f"scenario {seed}: {name} differs"
            if ref.dtype.is_floating_point:  # the same, on integer views (NaN-proof)
                int_dtype = {2: torch.int16, 4: torch.int32}[ref.element_size()]
                got_t = torch.frombuffer(bytearray(data), dtype=int_dtype) if data else torch.empty(0, dtype=int_dtype)
                assert torch.equal(got_t, ref.contiguous().reshape(-1).view(int_dtype))


def test_plan_batches_layout() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 300, (200,), generator=g).tolist() + [0, 1000, 0, 256, 255, 1]
    for buffer_size in (0, 1, 64, 256, 1000):
        batches = plan_batches(sizes, buffer_size)
        covered = [i for b in batches for i in range(b.start, b.stop)]
        assert covered == list(range(len(sizes)))
        for b in batches:
            if not b.packed:
                assert b.stop - b.start == 1 and sizes[b.start] > buffer_size and b.num_bytes == sizes[b.start]
                continue
            spans = [(o, o + sizes[i]) for o, i in zip(b.offsets, range(b.start, b.stop))]
            assert all(o % ALIGN == 0 for o, _ in spans)
            assert all(end <= b.num_bytes <= buffer_size for _, end in spans)
            assert all(prev_end <= o for (_, prev_end), (o, _) in zip(spans, spans[1:]))  # in order, no overlap
            assert b.num_bytes == spans[-1][1]
        # greedy: a packed batch is closed only by a tensor that would not fit
        for b, nxt in zip(batches, batches[1:]):
            if b.packed and nxt.packed:
                first = sizes[nxt.start]
                assert -(-b.num_bytes // ALIGN) * ALIGN + first > buffer_size


# -- config and factory --------------------------------------------------------------------------------------


def test_config_parse() -> None:
    assert WeightTransferConfig().backend == "nccl"
    assert WeightTransferConfig.parse('{"backend": "disk"}') == WeightTransferConfig("disk")
    assert WeightTransferConfig.parse({"backend": "ipc"}).backend == "ipc"
    config = WeightTransferConfig("nccl")
    assert WeightTransferConfig.parse(config) is config
    assert WeightTransferConfig.parse("{}").backend == "nccl"


@pytest.mark.parametrize("value, message", [
    ('{"backend": "rdma"}', "'rdma'"),
    ({"backend": None}, "one of nccl, ipc, disk"),
    ('{"backend": "disk", "path": "/x"}', r"unknown weight transfer config key\(s\) \['path'\]"),
    ('{"backend": ', "not valid JSON"),
    ('["nccl"]', "JSON object"),
])
def test_config_refuses(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightTransferConfig.parse(value)


def test_factory_and_cheap_import() -> None:
    for backend, cls in (("nccl", NCCLWeightTransferEngine), ("ipc", IPCWeightTransferEngine),
                         ("disk", DiskWeightTransferEngine)):
        engine = make_weight_transfer_engine(WeightTransferConfig(backend), "cpu", rank=2)
        assert type(engine) is cls and engine.rank == 2 and engine.device == torch.device("cpu")
    code = ("import sys, vllm, vllm.distributed; "
            "assert 'torch.distributed' not in sys.modules and 'torch' not in sys.modules; "
            "import vllm.distributed.weight_transfer; "
            "assert 'vllm.distributed.weight_transfer.nccl_engine' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ})


# -- nccl: refused input -------------------------------------------------------------------------------------

GOOD_INIT = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}


@pytest.mark.parametrize("change, message", [
    ({"master_port": None}, r"missing key\(s\) \['master_port'\]"),
    ({"extra": 1}, r"unknown key\(s\) \['extra'\]"),
    ({"master_port": "29555"}, "master_port must be an integer"),
    ({"master_port": True}, "master_port must be an integer"),
    ({"master_port": 70000}, "master_port must be an integer in"),
    ({"rank_offset": 0}, "rank_offset must be an integer >= 1"),
    ({"world_size": 1}, "world_size must be an integer >= 2"),
    ({"master_address": ""}, "master_address"),
    ({"rank_offset": 2}, r"rank_offset \(2\) \+ this worker's rank \(0\) must be below"),
])
def test_nccl_init_info_refused(change: dict, message: str) -> None:
    info = {k: v for k, v in {**GOOD_INIT, **change}.items() if v is not None}
    engine = make_weight_transfer_engine(WeightTransferConfig("nccl"), "cpu")
    with pytest.raises(ValueError, match=message):
        engine.init_transfer_engine(info)
    assert engine.model_update_group is None


def test_nccl_init_info_not_a_dict() -> None:
    engine = make_weight_transfer_engine(WeightTransferConfig("nccl"), "cpu")
    with pytest.raises(ValueError, match="init_info must be a JSON object"):
        engine.init_transfer_engine(["127.0.0.1"])


GOOD_UPDATE = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []]}


@pytest.mark.parametrize("change, message", [
    ({"dtype_names": ["bfloat16"]}, "dtype_names has 1 entries but names has 2"),
    ({"shapes": [[2, 3], [], [1]]}, "shapes has 3 entries but names has 2"),
    ({"dtype_names": ["bfloat16", "float31"]}, r"dtype_names\[1\]: unknown dtype name 'float31'"),
    ({"dtype_names": ["bfloat16", "torch.float32"]}, "unknown dtype name 'torch.float32'"),
    ({"shapes": [[2, -3], []]}, r"shapes\[0\] \(for 'a'\) must be a list of non-negative integers"),
    ({"shapes": [[2, 3.0], []]}, r"shapes\[0\]"),
    ({"names": ["a", "a"]}, "names has 'a' twice"),
    ({"names": "ab"}, "names must be a list"),
    ({"packed": "yes"}, "packed must be true or false"),
    ({"packed_buffer_size_bytes": 0}, "packed_buffer_size_bytes must be an integer >= 1"),
    ({"packed_num_buffers": 0}, "packed_num_buffers must be an integer >= 1"),
    ({"is_checkpoint_format": True}, r"unknown key\(s\) \['is_checkpoint_format'\]"),
    ({"names": None}, r"missing key\(s\) \['names'\]"),
])
def test_nccl_update_info_refused(change: dict, message: str) -> None:
    info = {k: v for k, v in {**GOOD_UPDATE, **change}.items() if v is not None}
    engine = make_weight_transfer_engine(WeightTransferConfig("nccl"), "cpu")
    with pytest.raises(ValueError, match=message):
        engine.parse_update_info(info)


def test_nccl_update_info_parsed() -> None:
    engine = make_weight_transfer_engine(WeightTransferConfig("nccl"), "cpu")
    info = engine.parse_update_info({**GOOD_UPDATE, "dtype_names": ["half", "float32"], "packed": True})
    assert info.names == ["a", "b"] and info.shapes == [(2, 3), ()]
    assert info.dtypes == [torch.float16, torch.float32] and info.packed
    assert info.packed_buffer_size_bytes == 1024 ** 3 and info.packed_num_buffers == 2  # vLLM's defaults
    with pytest.raises(RuntimeError, match="call init_transfer_engine first"):
        engine.receive_weights(info)


@pytest.mark.parametrize("args, message", [
    ({"group": None}, "trainer_args.group must be the group returned by"),
    ({"packed": True}, "missing key 'group'"),
    ({"group": None, "pack": True}, r"unknown key\(s\) \['pack'\]"),
])
def test_nccl_trainer_args_refused(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NCCLWeightTransferEngine.trainer_send_weights(iter([]), args)


def test_nccl_trainer_init_refused() -> None:
    with pytest.raises(ValueError, match=r"missing key\(s\) \['world_size'\]"):
        NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": 1})


# -- disk ----------------------------------------------------------------------------------------------------


def _checkpoint_tensors() -> dict[str, torch.Tensor]:
    return {name: tensor.contiguous() for name, tensor in _make_tensors(7)}


def _write_sharded(path: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Two shards plus an index; returns the names in shard order (each shard's header lists names sorted)."""
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, path / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [n for part in shards.values() for n in sorted(part)]


def _disk_engine() -> DiskWeightTransferEngine:
    engine = make_weight_transfer_engine(WeightTransferConfig("disk"), "cpu")
    engine.init_transfer_engine({})
    return engine


@pytest.mark.parametrize("layout", ["sharded", "single", "any_name"])
def test_disk_reads_headers_then_tensors(tmp_path: Path, layout: str) -> None:
    tensors = _checkpoint_tensors()
    if layout == "sharded":
        order = _write_sharded(tmp_path, tensors)
        (tmp_path / "stray.safetensors").write_bytes(b"not read: the index names the shards")
    else:
        save_file(tensors, tmp_path / ("model.safetensors" if layout == "single" else "weights.safetensors"))
        order = sorted(tensors)
    engine = _disk_engine()
    info = engine.parse_update_info({"path": str(tmp_path)})
    assert info.names == order
    assert info.dtype_names == [dtype_name(tensors[n].dtype) for n in order]
    assert info.shapes == [tuple(tensors[n].shape) for n in order]
    got = [(name, tensor.clone()) for name, tensor in engine.receive_weights(info)]
    assert [n for n, _ in got] == order
    for name, tensor in got:
        assert tensor.dtype == tensors[name].dtype and _as_bytes(tensor) == _as_bytes(tensors[name]), name


def test_disk_refuses(tmp_path: Path) -> None:
    engine = _disk_engine()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['path'\]"):
        engine.init_transfer_engine({"path": str(tmp_path)})
    with pytest.raises(ValueError, match="absolute folder path"):
        engine.parse_update_info({"path": "relative/ckpt"})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['path'\]"):
        engine.parse_update_info({})
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=f"{missing}.* is not a folder"):
        engine.parse_update_info({"path": str(missing)})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"{tmp_path}.* holds no .safetensors file"):
        engine.parse_update_info({"path": str(tmp_path)})

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=f"{bad}.*cannot read the safetensors header of model.safetensors"):
        engine.parse_update_info({"path": str(bad)})

    dup = tmp_path / "dup"
    dup.mkdir()
    save_file({"w": torch.ones(2), "a": torch.zeros(1)}, dup / "part-a.safetensors")
    save_file({"w": torch.ones(2)}, dup / "part-b.safetensors")
    with pytest.raises(ValueError, match=f"{dup}.*'w' is in both part-a.safetensors and part-b.safetensors"):
        engine.parse_update_info({"path": str(dup)})

    index_missing_shard = tmp_path / "index"
    index_missing_shard.mkdir()
    save_file({"w": torch.ones(2)}, index_missing_shard / "model-1.safetensors")
    (index_missing_shard / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-1.safetensors", "v": "model-2.safetensors"}}))
    with pytest.raises(ValueError, match="cannot read the safetensors header of model-2.safetensors"):
        engine.parse_update_info({"path": str(index_missing_shard)})


def test_disk_file_changed_after_parse(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "b": torch.ones(3)}, tmp_path / "model.safetensors")
    engine = _disk_engine()
    info = engine.parse_update_info({"path": str(tmp_path)})
    save_file({"a": torch.ones(2), "b": torch.ones(4)}, tmp_path / "model.safetensors")
    weights = engine.receive_weights(info)
    assert next(weights)[0] == "a"
    with pytest.raises(ValueError, match="changed after its headers were read"):
        next(weights)


# -- ipc -----------------------------------------------------------------------------------------------------


def _fake_handle(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple:
    # the structure torch.multiprocessing.reductions.reduce_tensor gives a CUDA tensor
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    stride = tuple(torch.empty(shape, device="meta").stride())
    args = (torch.Tensor, torch.Size(shape), stride, 0, torch.storage.TypedStorage, dtype, 0, b"h" * 64,
            4096, 0, False, b"r" * 16, 0, b"e" * 64, True)
    return rebuild_cuda_tensor, args


def _fake_ipc_update(**change) -> dict:
    handles = [{"GPU-1234": _fake_handle(torch.bfloat16, (2, 3))}, {"GPU-1234": _fake_handle(torch.float32, ())}]
    pickled = base64.b64encode(pickle.dumps(handles)).decode()
    return {k: v for k, v in {**GOOD_UPDATE, "ipc_handles_pickled": pickled, **change}.items() if v is not None}


def test_ipc_needs_cuda() -> None:
    engine = make_weight_transfer_engine(WeightTransferConfig("ipc"), "cpu")
    with pytest.raises(ValueError, match="the ipc backend needs CUDA"):
        engine.init_transfer_engine({})
    with pytest.raises(ValueError, match="the ipc backend needs CUDA"):
        engine.parse_update_info(_fake_ipc_update())


def test_ipc_update_info_decodes_pickled_handles() -> None:
    info = IPCWeightTransferUpdateInfo.from_dict(_fake_ipc_update())
    assert info.ipc_handles_pickled is None and len(info.ipc_handles) == 2
    assert info.ipc_handles[0]["GPU-1234"][1][5] == torch.bfloat16


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("change, message", [
    ({"ipc_handles_pickled": base64.b64encode(pickle.dumps([_Evil(), _Evil()])).decode()},
     "refers to (posix|os).system.*refusing to unpickle"),
    ({"ipc_handles_pickled": "not base64!"}, "not a base64 pickle of IPC handles"),
    ({"ipc_handles_pickled": None}, "exactly one of ipc_handles and ipc_handles_pickled"),
    ({"ipc_handles": []}, "exactly one of ipc_handles and ipc_handles_pickled"),
    ({"shapes": [[3, 2], []]}, r"ipc_handles\[0\] \(for 'a'\) holds a torch.bfloat16 tensor of shape \(2, 3\)"),
    ({"dtype_names": ["float16", "float32"]}, "announces float16"),
    ({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}, "got 2 for 1 names"),
    ({"ipc_handles_pickled": base64.b64encode(pickle.dumps([{"GPU-1": (print, ())}] * 2)).decode()},
     "refers to builtins.print"),
])
def test_ipc_update_info_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IPCWeightTransferUpdateInfo.from_dict(_fake_ipc_update(**change))


def _ipc_trainer(sent: mp.Queue, done: mp.Queue) -> None:
    torch.cuda.set_device(0)
    tensors = [(n, t.cuda()) for n, t in _make_tensors(11)]

    def send(update_info: dict) -> None:  # as the HTTP form would carry it
        handles = update_info.pop("ipc_handles")
        sent.put({**update_info, "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()})
        assert done.get(timeout=JOIN_TIMEOUT_S) == "copied"

    IPCWeightTransferEngine.trainer_send_weights(iter(tensors), {"send_mode": send})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_ipc_transfer_from_another_process_bit_exact() -> None:
    ctx = mp.get_context("spawn")
    sent, done = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=_ipc_trainer, args=(sent, done))
    trainer.start()
    try:
        engine = make_weight_transfer_engine(WeightTransferConfig("ipc"), torch.device("cuda", 0))
        engine.init_transfer_engine({})
        info = engine.parse_update_info(sent.get(timeout=JOIN_TIMEOUT_S))
        got = [(name, tensor.clone()) for name, tensor in engine.receive_weights(info)]
        torch.cuda.synchronize()
        done.put("copied")
    except queue.Empty:
        pytest.fail("the IPC trainer sent nothing")
    finally:
        trainer.join(timeout=JOIN_TIMEOUT_S)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
    expected = _make_tensors(11)
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, tensor), (_, ref) in zip(got, expected):
        assert tensor.is_cuda and tensor.dtype == ref.dtype and tuple(tensor.shape) == tuple(ref.shape), name
        assert _as_bytes(tensor) == _as_bytes(ref), name
