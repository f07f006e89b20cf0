"""GRU-family cells unrolled over time → one ai.ctropt sequence node (the ONNX GRU op: gru_op.py).

:func:`fuse_unrolled_cells` finds a GRU-family cell exported once per step of a Python loop (PyTorch,
paddle2onnx):

1. *step slices*: Gather(S, t, axis=1), Slice(S, t, t+1, axis 1) (+ Squeeze) or Split(S, axis 1) over every
   t in 0..T-1 of a sequence tensor S; each slice is a step input (x_t, the attention a_t, the mask m_t); x_t
   may also be a time-major step, the same ops along axis 0 of S [T, B, I] with the time axis dropped
   (paddle2onnx transposes the sequence, then slices and squeezes); a_t may be a step of a [B, T, 1] sequence
   (torch-rechub's DIEN: ``att.unsqueeze(-1)``). B is whatever rows S holds: torch-rechub selects the rows with a
   history first (NonZero → GatherND), so its steps run over N data-dependent rows, and so does the fused op;
2. *levels*: each value gets the highest step whose slices it depends on; the state s_t that the cells pass on
   is the one level-t value every level-t value that step t+2 reads derives from (the dominator of the chain);
3. *same cell every step*: each step's subgraph (from s_t back to s_{t-1}, its step slices, constants and shared
   values) is compared op by op, attribute by attribute and constant by constant with step 1's; step 0 binds
   the initial state;
4. *meaning*: the masking (``Where(m_t, h_new, s_{t-1})`` → ``mask`` = the mask's sequence tensor, padded output
   "state"; or FuxiCTR's DIEN blend m_t * h_new + (1 - m_t) * s_{t-1} of a bool mask cast to float, [B, T, 1]) is
   peeled off and :func:`ctropt.passes.rnn.cell.identify_gru_cell` reads step 1's cell
   (kind, linear_before_reset, att_keep, weights); a numeric check of the first steps (the exported nodes,
   slices included, against :func:`ctropt.ops.rnn.reference`, rows masked fully, partly and not at all) guards
   the rewrite.

The chain becomes one sequence node over the slices' sources (a time-major one transposed back): the last state
becomes Y_h, states stacked with Unsqueeze + Concat(axis 1) (or SequenceConstruct + ConcatFromSequence) become
Y; stacked along axis 0 (paddle2onnx: one Concat per step grown from an empty tensor) they become Y transposed.
A GRU cell over a_t * x_t is an AIGRU. A chain that is not read completely (other masking, other state readers,
shapes unknown) stays as is, and `notes` says which phase stopped it.

This module is the driver (`_Unroller`); the phases are `unrolled_steps.py` (1-3) and `unrolled_cell.py` (4),
and `unrolled_rewrite.py` writes the sequence node.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from ...graph.edit import const_value, is_all_zeros
from ...graph.shapes import Shapes
from ...graph import topological_order
from .unrolled_cell import _check, _read_cell
from .unrolled_rewrite import _chain_readers, _replace_chain
from .unrolled_steps import _Chain, _Group, _Miss, _step_slices, _Steps, MIN_STEPS


class _Unroller:
    """Finds the chains of unrolled steps, one length T at a time, and rewrites each one that reads completely;
    `misses` says why each chain found but left as is was left."""

    def __init__(self, graph: gs.Graph, opset: int, shapes: Shapes):
        self.graph, self.opset, self.shapes = graph, opset, shapes
        self.failed: set[int] = set()
        self.misses: list[tuple] = []          # (step 2's Tanh, why its chain was left)

    def scan(self):
        """The complete step groups (every step 0..T-1 sliced) by their length T."""
        groups = [g for g in _step_slices(self.graph, self.shapes) if self._complete(g)]
        # slices that feed another group's sequence (feature columns cut from a flat input, a lower layer's
        # steps) are not step inputs of a cell over that sequence: leave them out of the levels
        feeding, stack = set(), [g.source for g in groups]
        while stack:
            t = stack.pop()
            if id(t) in feeding:
                continue
            feeding.add(id(t))
            for n in t.inputs:
                stack.extend(n.inputs)
        groups = [g for g in groups if not any(id(o) in feeding for outs in g.steps.values() for o in outs)]
        by_T: dict[int, list[_Group]] = {}
        for g in groups:
            by_T.setdefault(len(g.steps), []).append(g)
        return by_T

    @staticmethod
    def _complete(g: _Group) -> bool:
        T = len(g.steps)
        return T >= MIN_STEPS and set(g.steps) == set(range(T))

    def find(self) -> tuple | None:
        """Rewrite the next chain that reads completely; its description, or None when none is left."""
        order = topological_order(list(self.graph.nodes))
        for T, groups in sorted(self.scan().items()):
            steps = _Steps(T, groups, order)
            for tanh in order:
                if tanh.op != "Tanh" or id(tanh) in self.failed or steps.lvl(tanh.outputs[0]) != 2:
                    continue
                try:
                    done = self._try(steps, tanh)
                except _Miss as e:
                    done = None
                    self.misses.append((tanh, f"cell unrolled over {T} steps (step 2 at {tanh.name}): {e}"))
                except Exception as e:  # anything unexpected: leave the chain as it is
                    done = None
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
                    self.misses.append((tanh, f"cell unrolled over {T} steps (step 2 at {tanh.name}): {why}"))
                if done:
                    return done
                self.failed.add(id(tanh))
        return None

    def _try(self, steps: _Steps, tanh2: gs.Node) -> str | None:
        """The chain whose step 2 computes `tanh2`, rewritten if it reads completely: its description."""
        chain = self._trace(steps, tanh2)
        if chain is None:
            return None
        return self._rewrite(steps, chain)

    @staticmethod
    def _trace(steps: _Steps, tanh2: gs.Node) -> _Chain | None:
        """Follow the state from step 0 through every step, each step's cell the same as step 1's (None: no state
        passed from step to step; _Miss: a step differs)."""
        T = steps.T
        s0 = steps.state_before(tanh2, 2)
        if s0 is None:
            return None
        found = steps.path_to_step(s0, 0)
        if found is None:
            return None
        leaf0, hops = found
        role = steps.step_of[id(leaf0)][1]
        g = steps.groups[role]
        states, nodes = [s0], [None] * T
        h_init = None
        for t in range(1, T):
            hit = None
            for start in g.steps[t]:
                for cand in steps.follow(start, hops):
                    if t == 1:
                        m = steps.match(cand, 1, s0, s0, 0, None)
                    else:
                        m = steps.match(states[1], 1, s0, cand, t, states[t - 1])
                    if m is not None:
                        hit = (cand, m)
                        break
                if hit:
                    break
            if hit is None:
                raise _Miss(f"step {t} does not compute step 1's cell (same ops, attributes, constants, slices)")
            cand, (ref_nodes, cand_nodes, bound_h) = hit
            if t == 1:
                h_init = bound_h
                nodes[0], nodes[1] = cand_nodes, ref_nodes
            else:
                nodes[t] = cand_nodes
            states.append(cand)
        return _Chain(T, states, h_init, nodes)

    def _rewrite(self, steps: _Steps, chain: _Chain) -> str | None:
        """Read the chain (its cell, masking and readers), check its first steps numerically and replace it by
        one sequence node: its description, or None where it does not read completely."""
        region = _chain_region(chain)
        if region is None:
            raise _Miss("a node belongs to two steps")
        cell = _read_cell(steps, self.shapes, self.opset, chain)
        readers = _chain_readers(self.graph, chain, region)
        if readers is None:
            raise _Miss("the graph reads the chain other than through the last state and the stacked states")
        stacked, need_h = readers
        h0_zero = is_all_zeros(chain.h0)
        if const_value(chain.h0) is not None and not h0_zero:
            raise _Miss("the initial state is a nonzero constant")
        if not _check(chain, cell, h0_zero, self.shapes, self.opset):
            raise _Miss("numeric check of the first steps against the reference op failed")
        return _replace_chain(self.graph, self.opset, self.shapes, chain, cell, stacked, need_h, h0_zero,
                              len(region))


def _chain_region(chain: _Chain) -> dict | None:
    """The nodes of every step's cell by id, or None if a node belongs to two steps."""
    region = {}
    for ns in chain.nodes:
        for n in ns:
            if id(n) in region:
                return None
            region[id(n)] = n
    return region


def fuse_unrolled_cells(graph: gs.Graph, opset: int, notes: list[str] | None = None) -> list[str]:
    """GRU-family cells unrolled over time steps → one sequence node. Returns what was fused; why chains were
    left as they are goes to `notes` when given."""
    done: list[str] = []
    shapes = Shapes(graph, symbolic=True)
    unroller = _Unroller(graph, opset, shapes)
    for _ in range(32):
        what = unroller.find()
        if not what:
            break
        done.append(what)
        graph.cleanup(remove_unused_graph_inputs=False)
    if notes is not None:  # chains still there (one tried under another length may have been fused since)
        present = {id(n) for n in graph.nodes}
        notes.extend(dict.fromkeys(why for tanh, why in unroller.misses if id(tanh) in present))
    if done:
        graph.toposort(mode="nodes")  # "full" recurses forever on graphs with If/Loop plus functions (gs 0.6.1)
    return done
