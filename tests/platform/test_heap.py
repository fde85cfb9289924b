"""trim_heap gives freed heap memory back: the trainer's resident memory after a step."""

import ctypes
import ctypes.util

from asyncrl.platform.heap import trim_heap


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def test_freed_heap_memory_goes_back_to_the_system():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    # Many 256 KB blocks (under malloc's mmap threshold: they live on the heap), touched, then
    # all but the last freed: the heap cannot shrink past the last one without a trim.
    blocks = [libc.malloc(256 * 1024) for _ in range(1200)]
    for block in blocks:
        libc.memset(block, 1, 256 * 1024)
    for block in blocks[:-1]:
        libc.free(block)
    before = _resident_bytes()
    assert trim_heap()
    released = before - _resident_bytes()
    libc.free(blocks[-1])
    assert released > 200 * 2**20, f"only {released / 2**20:.0f} MiB went back"
