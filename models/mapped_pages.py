"""Give back the resident pages of checkpoint tensors that were replaced.

The loader's tensors are views of the memory-mapped safetensors files (:mod:`models.checkpoint`). Once quantize has
replaced a layer's stored weight, its pages stay resident (and counted in the process's RSS) until the kernel needs
the memory or the last tensor of that file is freed: an 8B export from a bf16 checkpoint peaked at 19.3 GB in
quantize with the replaced layers' pages still resident beside the quantized ones (17.3 GB, in validate, with them
given back). ``MADV_PAGEOUT``
(Linux 5.4+) asks the kernel to reclaim them now. It is only a hint: a clean file page read again is read from the
file, so releasing a page still in use costs a re-read, never a wrong value. Anonymous memory is left alone (with
swap, paging it out would write soon-freed tensors to disk).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Iterable

import torch

MADV_PAGEOUT = 21  # linux/mman.h


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed mappings (/proc/self/maps rows with an inode)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def release_file_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Ask the kernel to reclaim the whole pages inside ``tensors`` that map a file; the bytes asked for. A no-op
    (0) off Linux, for tensors in anonymous memory, and where the kernel lacks ``MADV_PAGEOUT``."""
    if not sys.platform.startswith("linux"):
        return 0
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in tensors if t.device.type == "cpu" and t.numel() and t.is_contiguous()]
    if not spans:
        return 0
    files = _file_mappings()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    asked = 0
    for lo, hi in spans:
        start, end = -(-lo // page) * page, hi // page * page  # whole pages only: neighbours stay untouched
        if end > start and any(a <= start and end <= b for a, b in files):
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT) == 0:
                asked += end - start
    return asked
