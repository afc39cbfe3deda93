"""Weights sent to a stage in bounded chunks, written to a node-local cache file, checked, mapped;
a later open of the same manifest maps the cached file; corrupted or disordered chunks are refused."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.base import tensor_array
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.workers.shipping import (ALIGN, ShippingError, WeightManifest, WeightReceiver, _chunks,
                                        manifest)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return LlamaModel.load(write_synthetic(tmp_path_factory.mktemp("ship") / "m.gguf",
                                           SyntheticSpec(n_layer=3, tied=False, seed=9)))


def _names(model):
    return [n for n in model.weights if n.startswith("blk.1.") or n == "output.weight"]


def _send(model, names, m, recv, chunk):
    sizes = []
    for off, data in _chunks(model.weights, names, chunk):
        sizes.append(data.nbytes)
        recv.write(off, data.copy())
    recv.finish()
    return sizes


# chunks of at most `chunk` bytes rebuild the exact tensors, aligned, in a file named by the checksum
def test_chunks_rebuild_the_weights(model, tmp_path):
    names = _names(model)
    m = manifest(model.weights, names)
    recv = WeightReceiver(tmp_path)
    assert not recv.open(m)
    sizes = _send(model, names, m, recv, chunk=1000)
    assert max(sizes) <= 1000 and sum(sizes) == m.total and len(sizes) > 3
    got = recv.mapped()
    assert set(got) == set(names)
    for n in names:
        assert got[n].data % ALIGN == 0
        assert np.array_equal(tensor_array(got[n]), tensor_array(model.weights[n]))
    assert (tmp_path / f"{m.checksum}.bin").stat().st_size == m.total
    assert not list(tmp_path.glob("*.tmp*"))


# a second open (a later run, a restarted stage) finds the verified file: nothing to send
def test_cached_file_is_reused_and_verified(model, tmp_path):
    names = _names(model)
    m = manifest(model.weights, names)
    first = WeightReceiver(tmp_path)
    assert not first.open(m)
    _send(model, names, m, first, 4096)
    again = WeightReceiver(tmp_path)
    assert again.open(m)
    assert np.array_equal(tensor_array(again.mapped()[names[0]]), tensor_array(model.weights[names[0]]))
    path = tmp_path / f"{m.checksum}.bin"                  # a corrupted cache file is not trusted
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert not WeightReceiver(tmp_path).open(m)


# bytes that do not match the manifest's checksum, or chunks out of order, are refused
def test_corruption_and_disorder_refused(model, tmp_path):
    names = _names(model)
    m = manifest(model.weights, names)
    recv = WeightReceiver(tmp_path)
    recv.open(m)
    chunks = [(off, d.copy()) for off, d in _chunks(model.weights, names, 2048)]
    with pytest.raises(ShippingError, match="out of order"):
        recv.write(chunks[1][0], chunks[1][1])
    for off, d in chunks:
        if off == 0:
            d[5] ^= 1
        recv.write(off, d)
    with pytest.raises(ShippingError, match="corrupted"):
        recv.finish()
    assert not list(tmp_path.glob("*.bin*"))
    with pytest.raises(ShippingError, match="malformed"):
        WeightManifest.from_dict({**m.to_dict(), "checksum": "zz"})
    with pytest.raises(ShippingError, match="outside the file"):
        WeightManifest.from_dict({**m.to_dict(), "total": 1})
