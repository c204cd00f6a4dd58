#!/usr/bin/env python3
# Prints Megatron-Core's process groups for a layout as rows of the literal tables in
# tests/parallel/test_process_groups.cpp (MegatronGroups.*): {"tp", "0,1 2,3 ..."}, one row per group kind.
# Megatron's parallel_state.py imports torch, so this loads only RankGenerator, _inject_gtp_remat_axis and
# generate_masked_orthogonal_rank_groups out of the given tree (ast, no import) and builds the groups as
# initialize_model_parallel does: both generators with the same order, the intra-partial data-parallel groups as
# contiguous slices of each dp-cp group, the expert ones as the two levels of create_hierarchical_groups over each
# expert dp group ("(l s u) -> (l u) s"), the inter-instance group as its second level. ETP 0 = TP. Usage:
#   python3 tools/megatron_rank_groups.py MEGATRON_ROOT WORLD TP CP PP EP ETP ORDER N
# e.g. python3 tools/megatron_rank_groups.py /tmp/mlm 8 2 1 2 2 1 tp-cp-ep-pp-dp 1
import ast
import sys


def load(root):
    path = root.rstrip("/") + "/megatron/core/parallel_state.py"
    tree = ast.parse(open(path).read())
    keep = {"RankGenerator", "generate_masked_orthogonal_rank_groups", "_inject_gtp_remat_axis"}
    body = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in keep]
    ns = {"List": list, "Optional": object}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns


def hierarchical(ranks, sizes):  # create_hierarchical_groups' einops pattern, one list per level
    levels = []
    for level, s in enumerate(sizes):
        u = 1
        for v in sizes[:level]:
            u *= v
        n = len(ranks) // (u * s)
        levels.append([[ranks[(li * s + si) * u + ui] for si in range(s)] for li in range(n) for ui in range(u)])
    return levels


def main():
    root, world, tp, cp, pp, ep, etp, order, n = sys.argv[1:]
    world, tp, cp, pp, ep, etp, n = (int(v) for v in (world, tp, cp, pp, ep, etp, n))
    etp = etp or tp
    ns = load(root)
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    inj = ns["_inject_gtp_remat_axis"]
    dec = ns["RankGenerator"](tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=inj(order, after="tp"))
    exp = ns["RankGenerator"](tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=inj(order, after="ep"))
    out = {}
    for name, token in [("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp_cp", "dp-cp"),
                        ("tp_cp", "tp-cp"), ("tp_dp", "tp-dp"), ("tp_dp_cp", "tp-dp-cp"), ("mp", "tp-pp")]:
        out[name] = dec.get_ranks(token)
    for name, token in [("etp", "tp"), ("ep", "ep"), ("etp_ep", "tp-ep"), ("etp_ep_pp", "tp-ep-pp"), ("edp", "dp")]:
        out[name] = exp.get_ranks(token)
    intra = dp * cp // n
    out["intra_dp_cp"] = [g[i * intra:(i + 1) * intra] for g in out["dp_cp"] for i in range(n)]
    levels = [hierarchical(g, [edp // n, n]) for g in out["edp"]]
    out["intra_edp"] = [x for lv in levels for x in lv[0]]
    out["inter_dist_opt"] = [x for lv in levels for x in lv[1]]
    for name, groups in out.items():  # the test's table rows: groups apart by spaces, members by commas
        print(f'{{"{name}", "' + " ".join(",".join(map(str, g)) for g in groups) + '"},')


if __name__ == "__main__":
    main()
