import torch
dev="cuda"
for counts in ([16,32,16],[3,0,5],[7,9,0]):
    offs=torch.tensor(counts,device=dev).cumsum(0).to(torch.int32)
    T=sum(counts)+4; D=64; N=32; E=len(counts)
    x=torch.randn(T,D,device=dev,dtype=torch.bfloat16); w=torch.randn(E,N,D,device=dev,dtype=torch.bfloat16)
    g=torch.randn(T,N,device=dev,dtype=torch.bfloat16)
    try:
        out=torch._grouped_mm(x,w.transpose(-2,-1),offs=offs); torch.cuda.synchronize()
        ref=torch.cat([x[s:e]@w[i].t() for i,(s,e) in enumerate(zip([0]+offs.tolist()[:-1],offs.tolist()))])
        print(counts,"fwd err",(out[:sum(counts)].float()-ref.float()).abs().max().item(),"tail",out[sum(counts):].abs().max().item())
    except Exception as e: print(counts,"fwd fail",str(e)[:200])
    try:
        gw=torch._grouped_mm(g.t(),x,offs=offs); torch.cuda.synchronize()
        ref=torch.stack([g[s:e].t().float()@x[s:e].float() for s,e in zip([0]+offs.tolist()[:-1],offs.tolist())])
        print(counts,"wgrad err",(gw.float()-ref).abs().max().item())
    except Exception as e: print(counts,"wgrad fail",str(e)[:200])
