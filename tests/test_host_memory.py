"""``spmd.runtime.host_memory``: counting the fresh host pages a step touches, and what
``spmd run`` tells a user whose XLA:CPU steps fault their temporaries in afresh."""

from __future__ import annotations

import mmap

import pytest

from spmd.runtime.host_memory import (KEEP_FREED_MEMORY, NOTABLE_BYTES, fresh_memory_note,
                                      keeps_freed_memory, touched_pages)


def test_touched_pages_counts_first_touches():
    size = 16 * 2**20
    region = mmap.mmap(-1, size)  # mapped, not yet touched: every page faults once
    before = touched_pages()
    if before is None:
        pytest.skip("this system does not count page faults (no resource module)")
    page = mmap.PAGESIZE
    for offset in range(0, size, page):
        region[offset] = 1
    touched = touched_pages() - before
    region.close()
    assert size <= touched < 2 * size


def test_note_names_the_settings_only_where_it_matters():
    big = 32 * 2**20
    note = fresh_memory_note(big, 0.05, "cpu", environ={})
    assert "32.0 MiB of fresh pages" in note and "50 ms" in note
    assert all(f"{name}={value}" in note for name, value in KEEP_FREED_MEMORY.items())
    assert fresh_memory_note(big, 0.05, "gpu", environ={}) is None  # a GPU keeps its pool
    assert fresh_memory_note(NOTABLE_BYTES - 1, 0.05, "cpu", environ={}) is None
    assert fresh_memory_note(None, 0.05, "cpu", environ={}) is None  # not counted here
    kept = fresh_memory_note(big, 0.05, "cpu", environ=dict(KEEP_FREED_MEMORY))
    assert "told to keep freed memory already" in kept and "MALLOC_" not in kept


def test_both_settings_are_needed():
    assert keeps_freed_memory(dict(KEEP_FREED_MEMORY))
    one = dict(list(KEEP_FREED_MEMORY.items())[:1])
    assert not keeps_freed_memory(one) and not keeps_freed_memory({})
