"""Host-wide fresh-memory rates (`python memory_probe.py 1,2,4,8,16,24,32 2`): N processes at once, each for T s, per step of a 48 MB buffer (a batch of JPEG
bytes): reuse (one buffer written again), anon (mmap, write, munmap: a worker's join/bytearray), shm_write (a new
memfd mapped and written: the DataLoader's move into shared memory), shm_read (that memfd mapped afresh by a reader
and read: the receiving process), shm_read_populate (the same with MAP_POPULATE). GB/s of each step, summed over
the N processes (the step's time only)."""
import json, mmap, os, sys, time
from multiprocessing import Process, Queue
import numpy as np

SIZE = 48 << 20
STEPS = ("reuse", "anon", "shm_write", "shm_read", "shm_read_populate")

def work(seconds, q):
    src = np.ones(SIZE, np.uint8); dst = np.zeros(SIZE, np.uint8)
    spent = dict.fromkeys(STEPS, 0.0); n = 0; end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter(); dst[:] = src
        t1 = time.perf_counter(); m = mmap.mmap(-1, SIZE); np.frombuffer(m, np.uint8)[:] = src; m.close()
        t2 = time.perf_counter(); fd = os.memfd_create("b"); os.ftruncate(fd, SIZE)
        w = mmap.mmap(fd, SIZE); np.frombuffer(w, np.uint8)[:] = src; w.close()
        t3 = time.perf_counter(); r = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ); dst[:] = np.frombuffer(r, np.uint8); r.close()
        t4 = time.perf_counter()
        r = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        dst[:] = np.frombuffer(r, np.uint8); r.close(); os.close(fd)
        t5 = time.perf_counter()
        for k, a, b in zip(STEPS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            spent[k] += b - a
        n += 1
    q.put({k: n * SIZE / spent[k] / 1e9 for k in STEPS})

if __name__ == "__main__":
    counts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8").split(",")]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 3
    out = {}
    for n in counts:
        q = Queue(); ps = [Process(target=work, args=(seconds, q)) for _ in range(n)]
        [p.start() for p in ps]; rates = [q.get() for _ in ps]; [p.join() for p in ps]
        out[n] = {k: [round(sum(r[k] for r in rates), 2), round(min(r[k] for r in rates), 2)] for k in STEPS}
        print(n, "procs; GB/s total (slowest):", "  ".join(f"{k} {v[0]} ({v[1]})" for k, v in out[n].items()), flush=True)
    print(json.dumps(out))
