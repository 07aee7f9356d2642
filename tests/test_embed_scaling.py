"""scripts/embed_scaling.py's independent single-GPU embeds (its timings run on the device): embed i gets the
inputs rank i of a torchrun embed would, as embed's own chunk store deals them."""

import pytest

from tests.scripts import load_script
from vit_triton.pipelines.store import ChunkStore

EMBED_SCALING = load_script("embed_scaling.py")


@pytest.mark.parametrize("total", [0, 1, 7, 12, 13, 4097])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3, 4, 4096])
def test_rank_rows_are_the_chunks_embed_deals_that_rank(tmp_path, total, n, chunk):
    inputs = [f"img{i}.jpg" for i in range(total)]
    store = ChunkStore(tmp_path / "out.npy", {"input": str(tmp_path), "chunk_size": chunk})
    pending = store.pending(inputs)   # a fresh output: every chunk, dealt as embed deals them under torchrun
    rows = [EMBED_SCALING.rank_rows(total, n, chunk, rank) for rank in range(n)]
    for rank in range(n):
        assert rows[rank] == [i for k in pending[rank::n] for i in store.chunk_range(k, inputs)]
    assert sorted(i for r in rows for i in r) == list(range(total))
