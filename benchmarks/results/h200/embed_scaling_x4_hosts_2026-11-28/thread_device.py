"""Does a thread of a process whose main thread uses GPU k (k > 0) open a context on GPU 0?
Main thread: set_device(k). A new thread: enter and leave torch.cuda.stream(a stream of GPU k), then report its
current device; nvidia-smi's memory used on every GPU before and after (a context is ~0.5 GB)."""
import subprocess, sys, threading, time, torch
k = torch.cuda.device_count() - 1
def used():
    return subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout.split("\n")[:-1]
torch.cuda.set_device(k); torch.ones(1, device=f"cuda:{k}"); torch.cuda.synchronize()
time.sleep(1); before = used()
fix = len(sys.argv) > 1
seen = {}
def work():
    if fix:
        torch.cuda.set_device(k)
    seen["start"] = torch.cuda.current_device()
    s = torch.cuda.Stream(k)
    with torch.cuda.stream(s):
        seen["inside"] = torch.cuda.current_device()
        torch.ones(1, device=f"cuda:{k}") * 2
    seen["after"] = torch.cuda.current_device()
t = threading.Thread(target=work); t.start(); t.join()
torch.cuda.synchronize(); time.sleep(1)
print({"fix": fix, "gpu": k, "thread_current_device": seen, "memory_used_mb_before": before, "after": used()}, flush=True)
