import threading, traceback, torch, torch.nn.functional as F
from xcp.recurrent.kernels import recurrent_kernel, transition
k = recurrent_kernel("gated_delta_rule", "cuda")
S, H, D = 4096, 4, 128
x = [torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
g = F.logsigmoid(torch.randn(1, S, H, device="cuda") + 4); b = torch.rand(1, S, H, device="cuda").to(torch.bfloat16)
def go(tag):
    try:
        t, s, o, extra, carry = transition("gated_delta_rule").summarize_outputs(k.fn, [*x, g, b], {"use_qk_l2norm_in_kernel": True})
        print(tag, "probe ok", t.shape, s.shape, o.shape, extra[0].shape, flush=True)
        out, fin = k.fn(*x, g, b, initial_state=s.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True)
        print(tag, "h0 ok", out.shape, fin.dtype, flush=True)
    except Exception:
        traceback.print_exc()
go("main")
th = threading.Thread(target=go, args=("thread",)); th.start(); th.join()
s = torch.cuda.Stream()
def go2():
    with torch.cuda.stream(s):
        go("thread+stream")
th = threading.Thread(target=go2); th.start(); th.join()
import xcp
from xcp.cli.bench.recurrent import _gated_delta, VirtualStates, _whole
layer = _gated_delta(8192, 4, 128, torch.bfloat16, torch.device("cuda"))
out, _ = _whole(layer, None, False)
vs = VirtualStates(xcp.get_backend("cuda"), layer, 2, torch.randn_like(out))
try:
    vs.run(True)
    print("virtual ok", flush=True)
except Exception as e:
    traceback.print_exception(e.__cause__ or e)
