"""Worker for tests/test_hf_multiprocess.py: ``load_hf`` straight into FSDP shardings across
processes, then ``save_hf`` from that sharded model.

    python scripts/launch_local.py --processes 2 --devices 2 tests/multiprocess/hf_load.py -- CKPT OUT

1. counts the bytes this process reads while loading ``CKPT`` onto a mesh over every process's
   devices (FSDP over all of them) and prints ``BYTES process P read R expected E of T``: E is the
   size of the distinct slices this process's devices hold, T the whole model's;
2. loads ``CKPT`` in this process alone (no mesh) and prints ``EQUAL process P`` when every
   addressable shard of the sharded load equals it bit for bit;
3. ``save_hf`` of the sharded model into ``OUT`` (collective; process 0 writes).
Exits 1 on any mismatch.
"""

import sys

import jax
import numpy as np

import ringsplash.hf as rhf
from ringsplash import train

ckpt, out = sys.argv[1], sys.argv[2]
p = jax.process_index()
mesh = train.make_mesh(1, len(jax.devices()))
rhf.reset_bytes_read()
model = rhf.load_hf(ckpt, mesh=mesh)
read = rhf.bytes_read()

expected = total = 0
for x in jax.tree.leaves(model):
    total += x.nbytes
    distinct = {tuple((s.start, s.stop) for s in shard.index): shard.data.nbytes for shard in x.addressable_shards}
    expected += sum(distinct.values())
print(f"BYTES process {p} read {read} expected {expected} of {total}", flush=True)
ok = read == expected

plain = rhf.load_hf(ckpt)
for x, y in zip(jax.tree.leaves(model), jax.tree.leaves(plain), strict=True):
    for shard in x.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), np.asarray(y)[shard.index]):
            print(f"MISMATCH process {p} shard {shard.index} of shape {x.shape}", flush=True)
            ok = False
if ok:
    print(f"EQUAL process {p}", flush=True)

files = rhf.save_hf(model, out, max_shard_size=100_000)
print(f"SAVED process {p} files {len(files)}", flush=True)
sys.exit(0 if ok else 1)
