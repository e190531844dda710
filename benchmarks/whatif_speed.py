"""The cold what-if of Llama-2-7B (1 x 512, bf16, A100 80GB) in an empty cache, CPU seconds
(benchmarks/results/speed-2026-12-03-whatif.txt); speed.py --fronts times it beside MemTracker."""
import time, warnings, tempfile
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
from memfit import zoo
from memfit._cache import Cache
from memfit._trace_cache_scope import using
from memfit.studies import what_if
spec = zoo.get("llama-7b")
heard = []
with tempfile.TemporaryDirectory() as d, using(Cache(d)):
    t = time.process_time()
    rows = what_if(spec, batch_size=1, seq_len=512, device="a100-80gb", precision="bf16", on_progress=heard.append)
    print("what-if cpu s", round(time.process_time() - t, 2))
for r in rows: print(r)
