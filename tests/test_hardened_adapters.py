"""Adapter files a download brings (issue 42, items 3 and 6): an OxyGen `.npz` is judged by its zip directory and
`.npy` headers before any array is decompressed, a file name recorded in adapter.json cannot leave the export
folder, and `save_adapter(overwrite=True)` swaps the new adapter in whole, so no moment lacks one."""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile

import numpy as np
import pytest

from oxygen_jax.ckpts import adapters, own
from oxygen_jax.ckpts.adapters import load_adapter, save_adapter
from oxygen_jax.ckpts.oxygen_adapter import export_oxygen, import_oxygen, read_oxygen
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params
from test_oxygen_adapter import _oxygen_arrays, _write_oxygen

RANK, ALPHA = 3, 6.0
BIG = 16 << 20  # float32 elements of a 64 MB member (its zeros compress to ~64 kB)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    params = init_params(model_config("tiny"), 0)
    return params, own.save_params(tmp_path_factory.mktemp("hardened_base") / "base", params)


def _npy(shape, dtype=np.float32, data: bytes | None = None) -> bytes:
    """An .npy member: its header declares `shape`; its data is `data` (default: zeros of that size)."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape})
    out.write(bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize) if data is None else data)
    return out.getvalue()


def _with_member(folder, name: str, member: bytes) -> None:
    """Adds `name` to the folder's .npz (deflated, as np.savez_compressed stores members)."""
    (file,) = folder.glob("*.npz")
    with zipfile.ZipFile(file, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr(name, member)


def _refused_reading_little(call) -> str:
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as e:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated before the refusal"  # the member holds 64 MB
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_unknown_64_mb_member_is_refused_by_its_name_before_it_is_decompressed(base, tmp_path):
    params, _ = base
    src = _write_oxygen(tmp_path / "ox", _oxygen_arrays(params, RANK), RANK, ALPHA)
    _with_member(src, "PaliGemma/llm/layers/attn/extra.npy", _npy((BIG,)))
    message = _refused_reading_little(lambda: read_oxygen(src))
    assert "unknown key 'PaliGemma/llm/layers/attn/extra'" in message


def test_a_known_member_of_another_shape_is_refused_by_its_header_given_the_base(base, tmp_path):
    params, path = base
    arrays = _oxygen_arrays(params, RANK)
    key = "PaliGemma/llm/layers/mlp/linear_lora_b"
    src = _write_oxygen(tmp_path / "ox", {k: v for k, v in arrays.items() if k != key}, RANK, ALPHA)
    _with_member(src, key + ".npy", _npy((BIG // 64, 64)))
    message = _refused_reading_little(lambda: import_oxygen(src, tmp_path / "ours", base=path))
    assert f"key '{key}' has shape ({BIG // 64}, 64), expected" in message and not (tmp_path / "ours").exists()


def test_a_header_that_declares_more_than_the_member_holds_is_refused(base, tmp_path):
    params, _ = base
    arrays = _oxygen_arrays(params, RANK)
    key = "PaliGemma/llm/layers/mlp/linear_lora_b"
    src = _write_oxygen(tmp_path / "ox", {k: v for k, v in arrays.items() if k != key}, RANK, ALPHA)
    _with_member(src, key + ".npy", _npy((1 << 40,), data=b"\0" * 64))
    with pytest.raises(ValueError, match=r"header declares \(1099511627776,\) float32 .* but the member holds 64"):
        read_oxygen(src)


def test_an_export_refuses_a_recorded_file_name_that_leaves_its_folder(base, tmp_path):
    params, path = base
    src = _write_oxygen(tmp_path / "ox", _oxygen_arrays(params, RANK), RANK, ALPHA)
    ours = import_oxygen(src, tmp_path / "ours", base=path)
    meta = json.loads((ours / "adapter.json").read_text())
    meta["extra"]["oxygen"]["file"] = "../../escaped.npz"
    (ours / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a plain file name"):
        export_oxygen(ours, tmp_path / "back" / "inner", base=path)
    assert not list(tmp_path.rglob("escaped.npz"))


def test_an_overwrite_killed_mid_save_leaves_the_previous_adapter_whole(base, tmp_path, monkeypatch):
    params, path = base
    src = _write_oxygen(tmp_path / "ox", _oxygen_arrays(params, RANK), RANK, ALPHA)
    ours = import_oxygen(src, tmp_path / "ours", base=path)
    first, _ = load_adapter(ours, params.config, base=path)
    before = (ours / "adapter.json").read_bytes()

    def killed(new, dest):  # the process dies after writing the new adapter aside, before it is swapped in
        raise KeyboardInterrupt

    monkeypatch.setattr(adapters, "replace_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(ours, first, prompt="Other: ", base=path, overwrite=True)
    assert (ours / "adapter.json").read_bytes() == before and load_adapter(ours, params.config, base=path)
    monkeypatch.undo()
    assert save_adapter(ours, first, prompt="Other: ", base=path, overwrite=True) == ours
    assert json.loads((ours / "adapter.json").read_text())["prompt"] == "Other: "
    assert sorted(p.name for p in ours.parent.iterdir() if p.name.startswith(".")) == []  # nothing left aside


def test_replace_dir_swaps_whole_folders(tmp_path):
    old, new = tmp_path / "a", tmp_path / "new"
    old.mkdir()
    (old / "x").write_text("old")
    new.mkdir()
    (new / "x").write_text("new")
    adapters.replace_dir(new, old)
    assert (old / "x").read_text() == "new" and not new.exists()
