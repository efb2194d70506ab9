"""The int kernels' weights on 2 MiB pages (`models/kernels/huge_pages.py`): the same
values, read lazily, in memory advised for huge pages, and nothing moved where the kernel
lends none."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from aici_cli.models.kernels import huge_pages
from aici_cli.models.kernels.aligned import save_aligned, without_padding
from aici_cli.models.kernels.huge_pages import MIN_BYTES, OnHugePages

DTYPES = (torch.uint8, torch.float16, torch.float32, torch.int8)
needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason="transparent huge pages are off on this machine")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            current = (int(span.group(1), 16), int(span.group(2), 16))
        elif line.startswith("VmFlags:") and current and current[0] <= address < current[1]:
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _kept(tmp: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, dict[str, torch.Tensor]]:
    """`tensors` written as a kept file is (`save_aligned`) and mapped back as it is read
    (`packed_layers.read_packed`)."""
    file = tmp / "kept.safetensors"
    save_aligned(tensors, file)
    return file, without_padding(load_file(str(file)))


@needs_thp
@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 3 * MIN_BYTES)),
                      min_size=1, max_size=5),
       read=st.lists(st.booleans(), min_size=5, max_size=5))
def test_each_read_tensor_is_an_aligned_copy_with_its_values(
        sizes: list[tuple[torch.dtype, int]], read: list[bool]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tensors = {f"t{i}": torch.randint(-100, 100, (n // torch.empty(0, dtype=dt)
                                                      .element_size() + 1,)).to(dt)
                   for i, (dt, n) in enumerate(sizes)}
        file, mapped = _kept(Path(tmp), tensors)
        kept = OnHugePages(file, mapped)
        assert set(kept) == set(tensors) and len(kept) == len(tensors)
        for name, wanted in zip(tensors, read):
            if not wanted:
                continue
            got, given_t = kept[name], mapped[name]
            assert got.dtype == given_t.dtype and got.shape == given_t.shape
            assert torch.equal(got, tensors[name])
            big = given_t.numel() * given_t.element_size() >= MIN_BYTES
            # a big tensor is read into memory advised for huge pages, 64-byte aligned;
            # a small one is the mapped tensor
            assert (got.data_ptr() != given_t.data_ptr()) == big
            if big:
                assert got.data_ptr() % 64 == 0
                assert "hg" in _vm_flags(got.data_ptr())
                assert kept[name] is got  # read once


@needs_thp
def test_a_read_tensor_outlives_its_file_and_mapping(tmp_path: Path) -> None:
    file, mapped = _kept(tmp_path, {"w": torch.arange(MIN_BYTES, dtype=torch.int32)})
    got = OnHugePages(file, mapped)["w"]
    del mapped
    file.unlink()
    assert int(got[12345]) == 12345 and int(got[-1]) == MIN_BYTES - 1


@needs_thp
def test_a_file_replaced_since_its_header_was_read_is_not_read(tmp_path: Path) -> None:
    """A kept file is replaced whole when a run adds layers; the offsets read before then
    may not hold in the new one, so the mapped tensor is used."""
    file, mapped = _kept(tmp_path, {"w": torch.ones(MIN_BYTES, dtype=torch.uint8)})
    kept = OnHugePages(file, mapped)
    save_aligned({"x": torch.zeros(7), "w": torch.ones(MIN_BYTES, dtype=torch.uint8)},
                 tmp_path / "new")
    os.replace(tmp_path / "new", file)
    assert kept["w"].data_ptr() == mapped["w"].data_ptr()


def test_nothing_is_moved_where_huge_pages_are_off(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert not huge_pages.available()
    file, mapped = _kept(tmp_path, {"w": torch.ones(MIN_BYTES, dtype=torch.uint8)})
    assert OnHugePages(file, mapped)["w"].data_ptr() == mapped["w"].data_ptr()
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert not huge_pages.available()
