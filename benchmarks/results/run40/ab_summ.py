import collections, statistics, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 5:
        d[(p[0], p[1], int(p[2]), p[3])].append(float(p[4]))
keys = sorted({k[:3] for k in d})
for k in keys:
    a, b = d.get(k + ("wp1",), []), d.get(k + ("wp0",), [])
    if not a or not b: continue
    ratios = [y / x for x, y in zip(a, b)]
    print(f"W {k[0]:>4} {k[1]:4} N {k[2]:2}: prefetch {statistics.median(a):8.1f} us (min {min(a):7.1f}), none {statistics.median(b):8.1f} (min {min(b):7.1f}); none/prefetch median pair ratio {statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}] n={len(ratios)}")
