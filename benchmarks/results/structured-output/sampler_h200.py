"""What ran on the H200 (jax 0.11.2) for sampler-h200.json. The device tool ships the lead's
checkout, which does not have `sample(..., token_bitmask)` yet, so the mask step is inlined
here: `apply` is `runtime.sampler.apply_token_bitmask`, jitted into the same function as the
sampler (so XLA fuses it the same way). The host bitmask is transferred on every call, as in
the engine. Today's tree runs the same measurement as
`python -m benchmarks.structured_output --only sampler --vocab 151936 --mask-rows 64`."""
import time,statistics,json,sys,numpy as np,jax,jax.numpy as jnp
from runtime.sampler import sample
from runtime.sampling_metadata import SamplingMetadata
from runtime.types import SamplingParams
def apply(l,b):
    S,V=l.shape;bits=(b[:,:,None]>>jnp.arange(32,dtype=jnp.int32))&1
    return jnp.where(bits.reshape(S,-1)[:,:V]!=0,l,-jnp.inf)
res={}
for S in (8,64,256):
  V=151936;r=np.random.default_rng(0)
  lg=jax.device_put(r.normal(size=(S,V)).astype(np.float32))
  bm=np.full((S,(V+31)//32),-1,np.int32);bm[:S//2]=r.integers(-2**31,2**31,size=(S//2,bm.shape[1]),dtype=np.int64)
  for T in (1.0,0.0):
    g=T==0.0
    meta=jax.device_put(SamplingMetadata.from_params([SamplingParams(temperature=T,seed=i) for i in range(S)],[0]*S,[[]]*S,[[]]*S,pad_to=S))
    fp=jax.jit(lambda l,m: sample(l,m,all_greedy=g).tokens)
    fm=jax.jit(lambda l,m,b: sample(apply(l,b),m,all_greedy=g).tokens)
    def t(f,*a):
      for _ in range(3): f(*a).block_until_ready()
      x=[]
      for _ in range(30):
        t0=time.perf_counter();f(*a).block_until_ready();x.append((time.perf_counter()-t0)*1e3)
      return statistics.median(x)
    p=t(fp,lg,meta);m=t(fm,lg,meta,bm)
    res[f"S={S},{'greedy' if g else 'T=1'}"]=dict(plain_ms=round(p,3),masked_ms=round(m,3),ratio=round(m/p,3))
    print(S,T,p,m,m/p)
json.dump({"device":str(jax.devices()[0]),"jax":jax.__version__,"vocab":151936,"results":res},open(sys.argv[1],"w"),indent=1)
