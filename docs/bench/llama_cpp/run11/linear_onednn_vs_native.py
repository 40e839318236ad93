# oneDNN prepacked (dense_linear) against the native GEMM on AMX (InvariantLinear) over 30 layers of
# SmolLM2-135M shapes, bfloat16: the choice models/decode_plans.dense_copy makes (issue 32, run 11).
import time, torch
from goodserve.models.invariant import InvariantLinear, kernel_mode
from goodserve.models.linear import dense_linear
print(kernel_mode(), torch.get_num_threads())
def bench(f, n=200):
    for _ in range(10): f()
    t=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t)/n*1e6
# SmolLM2 layer shapes, 30 copies each to stream from memory as in a step
shapes=[(960,576),(576,576),(3072,576),(576,1536)]
for M in (5,8,16,32,64,512):
    tot={}
    for name, mk in (("onednn", lambda w: dense_linear(w, None)), ("bi", lambda w: InvariantLinear(w, None, torch.bfloat16))):
        layers=[[mk(torch.randn(n,k).bfloat16()) for (n,k) in shapes] for _ in range(30)]
        xs={k: torch.randn(M,k).bfloat16() for _,k in shapes}
        def step():
            for l in layers:
                for lin,(n,k) in zip(l,shapes): lin(xs[k])
        tot[name]=bench(step, 20 if M<512 else 5)
    print(M, {k: f"{v/1e3:.2f} ms" for k,v in tot.items()})
