"""CUDA memory whose virtual addresses outlive its physical pages: the driver's virtual memory management API
(cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease), called through
ctypes on libcuda.

Sleep mode (vllm/v1/worker/sleep.py) keeps the model's weights and the KV cache each in one `CudaRegion`: the
address range is reserved once, for the life of the engine; `release()` unmaps and frees the physical memory
(the trainer sharing the GPU gets it), `restore()` creates new physical memory and maps it at the same
addresses. Every pointer baked into a captured CUDA graph (decode, mixed, sampler graphs) therefore stays
valid, and nothing is re-captured.

Why ctypes and not a C++ extension with a torch pluggable allocator (vLLM's cumem allocator): the regions here
are built by the engine itself, after the model is loaded (its tensors are moved into one region) and when the
KV cache is made (allocated in its region directly), so nothing has to intercept torch's allocations; six
driver calls are all it takes, with no build step, so `pip install -e .` stays pure Python on every machine
and a CPU install never meets a CUDA toolchain. The cost is one copy of the weights at start-up.

`pinned_host_buffer(nbytes, device)` is sleep mode's host backup of the weights: page-locked host memory of
exactly `nbytes` from the driver (cuMemHostAlloc), allocated once at start-up. torch's pinned allocator would
round a 3.1 GB request up to 4 GB (its blocks are powers of two) and, allocated at the first sleep, made that
sleep pay for pinning every page (over 1 s on an H100 for Qwen2.5-1.5B's weights, against 0.085 s for a sleep
that found its buffer).

Invariants:
- `flat` (a uint8 tensor over the whole region) and every view of it keep their addresses for the life of the
  region; their contents are undefined after `restore()` until written.
- No kernel may touch the region between `release()` and `restore()` (the caller halts the engine and
  synchronises the device first); the physical memory is the whole region's, mapped in one piece.
- A pinned host buffer lives as long as any tensor over it (its storage holds the memory's owner), and is freed
  with the last one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import weakref

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_NONE = 0
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_CU_MEMHOSTALLOC_PORTABLE = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp (cuda.h)."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc (cuda.h)."""
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _driver() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            name = ctypes.util.find_library("cuda") or "libcuda.so.1"
            lib = ctypes.CDLL(name)
            u64, size_t, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
            for fn, argtypes in {
                "cuGetErrorString": [ctypes.c_int, p(ctypes.c_char_p)],
                "cuDeviceGet": [p(ctypes.c_int), ctypes.c_int],
                "cuCtxGetCurrent": [p(ctypes.c_void_p)],
                "cuCtxSetCurrent": [ctypes.c_void_p],
                "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
                "cuMemGetAllocationGranularity": [p(size_t), p(_AllocationProp), ctypes.c_int],
                "cuMemAddressReserve": [p(u64), size_t, size_t, u64, ctypes.c_ulonglong],
                "cuMemAddressFree": [u64, size_t],
                "cuMemCreate": [p(u64), size_t, p(_AllocationProp), ctypes.c_ulonglong],
                "cuMemRelease": [u64],
                "cuMemMap": [u64, size_t, size_t, u64, ctypes.c_ulonglong],
                "cuMemUnmap": [u64, size_t],
                "cuMemSetAccess": [u64, size_t, p(_AccessDesc), size_t],
                "cuMemHostAlloc": [p(ctypes.c_void_p), size_t, ctypes.c_uint],
                "cuMemFreeHost": [ctypes.c_void_p],
            }.items():
                f = getattr(lib, fn)
                f.argtypes, f.restype = argtypes, ctypes.c_int
            _lib = lib
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"CUDA driver call {what} failed: {message} (CUresult {result}).")


def _ensure_context(ordinal: int) -> None:
    """Driver calls need a current context on the calling thread: torch's (the device's primary one)."""
    lib = _driver()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def pinned_host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A CPU uint8 tensor [nbytes] over page-locked host memory of exactly `nbytes` (module docstring), usable for
    asynchronous copies from and to `device`; freed with the last tensor over it."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    _ensure_context(ordinal)
    lib = _driver()
    ptr = ctypes.c_void_p()
    _check(lib.cuMemHostAlloc(ctypes.byref(ptr), nbytes, _CU_MEMHOSTALLOC_PORTABLE),
           f"cuMemHostAlloc ({nbytes / (1 << 30):.2f} GiB)")
    owner = (ctypes.c_ubyte * nbytes).from_address(int(ptr.value))
    # NOTE: the tensor's storage keeps `owner` alive; the memory goes back when the last tensor over it does. Not
    # at interpreter exit, when the driver may be gone already (the process's memory goes back anyway).
    weakref.finalize(owner, _free_host, int(ptr.value), ordinal).atexit = False
    return torch.frombuffer(owner, dtype=torch.uint8)


def _free_host(ptr: int, ordinal: int) -> None:
    # NOTE: a garbage collection may run this on any thread; a failure leaks the buffer rather than raise there.
    try:
        _ensure_context(ordinal)
        _driver().cuMemFreeHost(ptr)
    except RuntimeError:
        pass


class _CudaArray:
    """What torch.as_tensor reads: a uint8 vector at a raw device address (the CUDA array interface, v3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class CudaRegion:
    """`nbytes` of device memory at a fixed virtual address range (module docstring); resident when made."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self._ensure_context()
        lib = _driver()
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_NONE
        self._prop.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.ordinal
        granularity = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop),
                                                 _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity")
        g = max(int(granularity.value), 1)
        self.nbytes = nbytes
        self.size = max(-(-nbytes // g) * g, g)  # what is reserved and mapped: whole granules
        ptr = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), self.size, g, 0, 0), "cuMemAddressReserve")
        self.ptr = int(ptr.value)
        self._handle: int | None = None
        try:
            self.restore()
        except BaseException:
            lib.cuMemAddressFree(self.ptr, self.size)
            raise
        self.flat = torch.as_tensor(_CudaArray(self.ptr, nbytes), device=device)

    @property
    def resident(self) -> bool:
        return self._handle is not None

    def _ensure_context(self) -> None:
        _ensure_context(self.ordinal)

    def restore(self) -> None:
        """New physical memory mapped at the region's addresses (contents undefined); a no-op when resident.
        Raises (and stays released) when the device has not that much memory free."""
        if self._handle is not None:
            return
        self._ensure_context()
        lib = _driver()
        handle = ctypes.c_uint64()
        _check(lib.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0),
               f"cuMemCreate ({self.size / (1 << 30):.2f} GiB)")
        try:
            _check(lib.cuMemMap(self.ptr, self.size, 0, handle.value, 0), "cuMemMap")
            access = _AccessDesc()
            access.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.ordinal
            access.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _check(lib.cuMemSetAccess(self.ptr, self.size, ctypes.byref(access), 1), "cuMemSetAccess")
        except BaseException:
            lib.cuMemUnmap(self.ptr, self.size)
            lib.cuMemRelease(handle.value)
            raise
        self._handle = int(handle.value)

    def release(self) -> None:
        """Unmap and free the physical memory, keeping the address range; a no-op when released. The caller has
        synchronised the device."""
        if self._handle is None:
            return
        self._ensure_context()
        lib = _driver()
        _check(lib.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
        _check(lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None
