"""Run 41: replay the logged rounds through the adaptive controller's extend/trim arithmetic, predicting the next
undrafted position by the pooled acceptance or by the acceptance after the last draft's confidence bucket."""
import collections
import itertools
import json
log=json.load(open('benchmarks/results/run41/lookahead-keys-strict.json'))
own=collections.defaultdict(lambda:[0,0]); after=collections.defaultdict(lambda:[0,0]); pooled=[0,0]
for keys,n in log:
    for i,k in enumerate(keys):
        if i>n: break
        acc=i<n; own[k][0]+=acc; own[k][1]+=1; pooled[0]+=acc; pooled[1]+=1
        if i>0: after[keys[i-1]][0]+=acc; after[keys[i-1]][1]+=1
A={k:v[0]/v[1] for k,v in own.items()}; P=pooled[0]/pooled[1]
AF={k:(v[0]+2*P)/(v[1]+2) for k,v in after.items()}
def run(costs, c, cond):
    cost=lambda w: costs[w-1] if w<=len(costs) else costs[-1]+(costs[-1]-costs[-2])*(w-len(costs))
    # R: plan rate = best expected rate with pooled acceptance, as choose() computes
    R=max((1-P**(k+1))/(1-P)/(cost(k+1)+c*k) for k in range(0,9))
    tok=tim=0
    for keys,n in log:
        m=0
        while m<len(keys):
            an = (AF.get(keys[m-1],P) if (cond and m>0) else P)
            # gains for j>=m: known prefix product, then a_next for the first unknown, pooled after
            # the known prefix: P(all m drafted accepted) and its expected tokens
            prods=list(itertools.accumulate((A[k] for k in keys[:m]), lambda x,y:x*y))
            pre=prods[-1] if prods else 1.0
            base=1+sum(prods)
            g=[base - R*(cost(m+1)+c*m)]; tot=base; run_=pre
            for j in range(m+1,len(keys)+1):
                run_*= an if j==m+1 else P
                tot+=run_; g.append(tot - R*(cost(j+1)+c*j))
            if max(g[1:])>g[0]: m+=1
            else: break
        # trim: drafting paid; keep best j by E[tokens]-R*cost
        best=0;bv=-1e9;tot=1;run_=1
        for j in range(m+1):
            if j: run_*=A[keys[j-1]]; tot+=run_
            v=tot-R*cost(j+1)
            if v>=bv: bv=v;best=j
        tok+=min(best,n)+1; tim+=cost(best+1)+c*m
    return tok/tim
for name,costs,c in [('w768 Q4_K_M zen3',[82,134,188,212,245,297,310,340,380],11.6),('F16 narrow zen3',[89,111,147,172,182,199,230,264,275],11.5),('flat (GPU-like)',[60,62,64,66,68,70,72,74,76],6)]:
    plain=1000/costs[0]
    a=run(costs,c,False); b=run(costs,c,True)
    print(f"{name}: plain {plain:.1f} pooled-next {1000*a:.2f} ({1000*a/plain:.3f}x) conditioned-next {1000*b:.2f} ({1000*b/plain:.3f}x) gain {b/a:.3f}")
