"""Adapter-aware GLiNER2 heads: every row of a mixed batch gets its own adapter's head LoRA.

The GPU stage calls GLiNER2's span/count/classifier heads on tensors whose rows belong to
different requests:

* ``count_pred`` on one stacked row per (request, span task),
* ``span_rep``'s token projections on ``[requests, tokens, hidden]``,
* ``count_embed`` once per (request, span task), ``classifier`` once per (request, task).

Each head ``nn.Linear`` is wrapped by ``HeadLoraLinear``, which adds
``scale[slot] * (x A[slot]^T) B[slot]^T`` with the slot either per leading row of its
input (``rows``) or one for the whole call (``single``). The GPU stage calls our own
batch-wide versions of GLiNER2's head passes (``span_logits``: the same computation as
GLiNER2's ``_compute_direct_span_logits_batched``; ``classification_probabilities``: as its
``_compute_classification_probabilities``), with the row slots known; no GLiNER2 method is
replaced. Decoding is ``manylora.post``'s.

Where GLiNER2 reads a head weight directly instead of calling the module (the two
``out_project`` layers in ``score_queries``), PEFT's LoRA is not applied by GLiNER2
either; serving does the same, so answers still equal GLiNER2 + PEFT.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import torch
from torch import nn

from manylora.decode import device_lists, device_tensor
from manylora.lora.store import AdapterStore

HEAD_MODULES = ("span_rep", "classifier", "count_pred", "count_embed")
SPAN_TASK_MARKERS = ("[E]", "[C]", "[R]")


class HeadLoraLinear(nn.Module):
    def __init__(self, name: str, base: nn.Linear, store_ref: "HeadLoras"):
        super().__init__()
        self.name = name
        self.base = base
        self._heads = store_ref
        # this call's slots, set by HeadLoras._set in place (no nn.Module attribute set per call):
        # None, ("single", slot) for one slot for the whole call, or ("rows", index, selected, scales)
        # per leading row of the input: index [N] its slot clamped at 0, selected [N, 1, 1] slot >= 0
        # (None when every row has an adapter), scales [modules, N, 1, 1] every module's row scales
        self.call: list = [None]

    @property
    def weight(self) -> torch.Tensor:  # GLiNER2 reads .weight of some head layers directly
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        store = self._heads.store
        call = self.call[0]
        if store is None or call is None:
            return y
        out = y.shape[-1]
        if call[0] == "single":
            slot = call[1]
            v = nn.functional.linear(x, store.a[self.name][slot]) * store.scales[self.name][slot].to(x.dtype)
            y.view(-1, out).addmm_(v.view(-1, v.shape[-1]), store.b[self.name][slot].t())  # + v Bᵀ in the GEMM
            return y
        _, index, selected, row_scales = call
        # gathered in the store's layout (whole contiguous [R, in] and [out, R] blocks per row), then
        # transposed as views: a gather from transposed views would read them with a stride
        a = store.a[self.name].index_select(0, index).transpose(1, 2)  # [N, in, R]
        n = x.shape[0]
        v = torch.bmm(x.reshape(n, -1, x.shape[-1]), a) * row_scales[store.scale_rows[self.name]]
        b = store.b[self.name].index_select(0, index).transpose(1, 2)  # [N, R, out]
        if selected is not None:
            # rows without an adapter gathered slot 0: their factors are selected away, never
            # multiplied by zero (a non-finite slot 0 would make NaN x 0 = NaN for them)
            zero = torch.zeros((), dtype=v.dtype, device=v.device)
            v, b = torch.where(selected, v, zero), torch.where(selected, b, zero)
        # y += v B per row inside the batched GEMM (it reads y in its epilogue): the update's own
        # [N, M, out] tensor and its scale, select and add passes over it were 1.4 ms of GPU time
        # in a 150-row LoRA chunk (H200 kernel table, perf/profile_core.py, session 20)
        y.view(n, -1, out).baddbmm_(v, b)
        return y


class HeadLoras:
    """Wraps every nn.Linear under GLiNER2's head modules, in place, and routes slots to them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.store: Optional[AdapterStore] = None
        self.linears: dict[str, HeadLoraLinear] = {}
        self._by_prefixes: dict[tuple, list[HeadLoraLinear]] = {}  # _set's layers per prefixes
        self.row_slots: Optional[Sequence[int]] = None  # slot per row of the batch being decoded
        # the dense span scores through kernels/spanscores.py instead of GLiNER2's score_queries
        # (the engine's fused_span_scores parameter; a GPU with the triton backend)
        self.span_kernel = False
        # entity-only chunks: the count gates the hits on the GPU instead of a wait for it in the
        # heads (span_logits_dense); False waits as for other tasks (perf/profile_core.py's A/B)
        self.count_gate = True
        # CUDA graphs of entity-only chunks' heads (manylora.lora.head_graphs.HeadGraphs), or None
        self.graphs = None
        for prefix in HEAD_MODULES:
            root = getattr(model, prefix, None)
            if root is None:
                continue
            for name, module in list(root.named_modules()):
                if isinstance(module, nn.Linear):
                    parent_name, _, child = name.rpartition(".")
                    parent = root.get_submodule(parent_name) if parent_name else root
                    full = f"{prefix}.{name}"
                    wrapper = HeadLoraLinear(full, module, self)
                    setattr(parent, child, wrapper)
                    self.linears[full] = wrapper

    def _layers(self, prefixes: tuple[str, ...]) -> list[HeadLoraLinear]:
        layers = self._by_prefixes.get(prefixes)
        if layers is None:
            layers = self._by_prefixes[prefixes] = [m for n, m in self.linears.items() if n.startswith(prefixes)]
        return layers

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: (m.base.in_features, m.base.out_features) for n, m in self.linears.items()}

    @contextmanager
    def batch(self, batch, row_slots: Sequence[int]):
        """Decode ``batch`` with ``row_slots[i]`` as row i's adapter slot (-1 = base)."""
        self.row_slots = list(row_slots)
        try:
            yield
        finally:
            self.row_slots = None

    @contextmanager
    def _set(
        self,
        prefixes: tuple[str, ...],
        rows: Optional[Sequence[int]] = None,
        single: Optional[int] = None,
        rows_on_device: Optional[torch.Tensor] = None,
    ):
        """The head layers under ``prefixes`` apply ``rows[i]``'s adapter to leading row i of their
        input, or ``single``'s to all, inside the block (``rows_on_device``: ``rows`` on the
        GPU already, from ``device_lists``)."""
        if rows is not None and rows and rows[0] >= 0 and all(s == rows[0] for s in rows):
            # every row the same adapter (a lone request, a one-adapter chunk): two GEMMs, where the
            # per-row path gathers, runs two batched GEMMs and selects (H200 profile_core, one LoRA row:
            # 8 head linears took 3 ms of host time that way)
            rows, single = None, rows[0]
        active = (
            self.store is not None
            and self.row_slots is not None
            and ((rows is not None and any(s >= 0 for s in rows)) or (single is not None and single >= 0))
        )
        chosen = self._layers(prefixes) if active else []
        call = None
        if chosen and rows is not None:
            slots = rows_on_device
            if slots is None:
                slots = device_tensor(list(rows), next(iter(self.linears.values())).base.weight.device)
            # the mask only where a row has no adapter (None: every row is selected)
            call = self._rows_call(chosen, slots, masked=not all(s >= 0 for s in rows))
        elif chosen:
            call = ("single", single)
        with self._calls(chosen, call):
            yield

    def _rows_call(self, chosen: list, slots: torch.Tensor, masked: bool) -> tuple:
        """The per-row call of ``HeadLoraLinear`` for ``slots`` (on the device, -1: no adapter): the
        rows' gather index, their mask (when ``masked``) and every module's scale of each row,
        once for all ``chosen`` layers (three launches fewer per layer)."""
        index = slots.clamp(min=0)
        mask = (slots >= 0).view(-1, 1, 1) if masked else None
        dtype = chosen[0].base.weight.dtype
        scales = self.store.scale_table.index_select(1, index).to(dtype).view(-1, slots.shape[0], 1, 1)
        return ("rows", index, mask, scales)

    @contextmanager
    def _calls(self, chosen: list, call):
        for module in chosen:
            module.call[0] = call
        try:
            yield
        finally:
            for module in chosen:
                module.call[0] = None

    @contextmanager
    def slots_on_device(self, prefixes: tuple[str, ...], slots: Optional[torch.Tensor]):
        """``_set`` for slots only on the device (-1: no adapter), always through the per-row path
        with its mask: the same launches whatever the slots hold (a CUDA graph's body,
        ``manylora.lora.head_graphs``). ``slots`` None: no head LoRA."""
        chosen = self._layers(prefixes) if self.store is not None and slots is not None else []
        with self._calls(chosen, self._rows_call(chosen, slots, masked=True) if chosen else None):
            yield

    def span_logits(self, batch, all_token_embs, all_schema_embs):
        """GLiNER2's direct span logits for a whole batch, with each row's head LoRA.

        Same computation and return layout as GLiNER2's ``_compute_direct_span_logits_batched``
        (``[count, fields, L, W]`` logits and predicted counts per (row, task)).
        """
        model = self.model
        rows = len(batch)
        slots = self.row_slots if self.row_slots is not None else [-1] * rows
        raw_logits = [[None] * len(batch.task_types[i]) for i in range(rows)]
        pred_counts = [[0] * len(batch.task_types[i]) for i in range(rows)]

        records = []  # (row, task, stacked schema embeddings) of every span task
        for row in range(rows):
            if all_token_embs[row].numel() == 0:
                continue
            for task, task_type in enumerate(batch.task_types[row]):
                if task_type == "classifications" or task >= len(all_schema_embs[row]):
                    continue
                embeddings = all_schema_embs[row][task]
                tokens = batch.schema_tokens_list[row][task]
                if not embeddings or len(tokens) < 4:
                    continue
                if not any(tokens[j] in SPAN_TASK_MARKERS for j in range(len(tokens) - 1)):
                    continue
                records.append((row, task, torch.stack(embeddings)))
        if not records:
            return raw_logits, pred_counts

        with self._set(("count_pred",), rows=[slots[row] for row, _, _ in records]):
            counts = model.count_pred(torch.stack([e[0] for _, _, e in records])).argmax(dim=-1).tolist()

        counted = [
            (row, task, embeddings, int(count)) for (row, task, embeddings), count in zip(records, counts) if count > 0
        ]
        for (row, task, _), count in zip(records, counts):
            pred_counts[row][task] = int(count)
        queries: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        offsets = [0] * rows
        where = {}
        for (row, task, _, count), projected in zip(counted, self._count_embed(counted, slots)):
            if projected.numel() == 0:
                continue
            if batch.task_types[row][task] == "entities":
                projected = projected[:1]  # entity decoding reads instance 0 only
            count_dim, field_dim, hidden = projected.shape
            where[(row, task)] = (offsets[row], offsets[row] + count_dim * field_dim, count_dim, field_dim)
            offsets[row] += count_dim * field_dim
            queries[row].append(projected.reshape(count_dim * field_dim, hidden))

        active = [row for row in range(rows) if queries[row]]
        if not active:
            return raw_logits, pred_counts
        with self._set(("span_rep",), rows=[slots[row] for row in active]):
            logits = model.compute_span_scores_batched(
                [all_token_embs[row] for row in active], [torch.cat(queries[row]) for row in active], mask_invalid=True
            )
        by_row = dict(zip(active, logits))
        for (row, task), (start, stop, count_dim, field_dim) in where.items():
            task_logits = by_row[row][start:stop]
            raw_logits[row][task] = task_logits.reshape(count_dim, field_dim, *task_logits.shape[-2:])
        return raw_logits, pred_counts

    def span_logits_dense(self, batch, hidden: torch.Tensor, t_min: Optional[Sequence[float]] = None):
        """``span_logits`` for a whole batch without a tensor operation per row.

        ``hidden``: the [B, L, H] token states GLiNER2's heads read (``encode_padded``). Gathers
        every row's word states, prompt and field embeddings with one index operation each,
        runs the count head, the batched count embedding and one ``score_queries`` on the
        padded tokens and queries of the rows that have queries: the tensors GLiNER2's
        ``compute_span_scores_batched`` builds, so the logits are the same values. Returns
        ``(logits [A, Q, Lw, W] or None, plan)``; ``plan`` holds, per active row, its batch row,
        word count and ``(task, first query, count, fields)`` of each span task with logits,
        and ``pred_counts[row][task]`` for every row.

        An entity-only chunk (the count gate) replays a CUDA graph of the whole step when
        ``graphs`` is set and each row's lowest threshold ``t_min`` is given
        (``manylora.lora.head_graphs``): then the logits are None and ``plan["graphed"]`` holds
        the scores and the mask of hits that ``post.compact_dense_begin`` would compute.

        Measured (H200, perf/profile_core.py): the per-row gathers, stacks, concatenations and
        padding copies of the list path were about half of the GPU stage's host time per row.
        Its index lists go to the GPU in one copy for an entity-only chunk (two otherwise), where
        each took three operations and a pinned copy (``device_lists``): ``perf/count_head_ops.py``
        on the CPU host, operations per chunk 287 -> 261 for 64 LoRA rows, 149 -> 132 for base
        rows, plus ~11 pinned copies fewer on a GPU. Not yet timed on a GPU (session 19).
        """
        model = self.model
        rows = len(batch)
        slots = self.row_slots if self.row_slots is not None else [-1] * rows
        device = hidden.device
        pred_counts = [[0] * len(batch.task_types[i]) for i in range(rows)]
        words = batch.text_word_counts
        records = []  # (row, task, positions of prompt + fields)
        templates: dict = {}  # per schema (the rows of one schema share its lists): its span tasks
        for row in range(rows):
            if words[row] == 0:
                continue
            specials, types = batch.schema_special_indices[row], batch.task_types[row]
            tokens, count = batch.schema_tokens_list[row], batch.schema_counts[row]
            key = (id(specials), id(types), id(tokens), count)
            spans = templates.get(key)
            if spans is None:
                spans = templates[key] = _span_tasks(specials, types, tokens, count)
            records.extend([(row, task, positions) for task, positions in spans])
        plan = {"pred_counts": pred_counts, "rows": []}
        if not records:
            return None, plan
        count_slots = [slots[r] for r, _, _ in records]
        prompts = ([r for r, _, _ in records], [p[0] for _, _, p in records], count_slots)
        counted, counted_records = [], []  # the tasks with queries, and each one's index in records
        gated = self.count_gate and all(batch.task_types[row][task] == "entities" for row, task, _ in records)
        if gated:
            # entity tasks only: GLiNER2 scores instance 0 of a task with a count above 0, and the
            # count embedding's step 0 does not depend on the count. So the count is not waited
            # for here (a sync in the middle of each chunk's heads): every task with fields gets
            # its queries, the count gates its hits on the GPU, and the counts reach the host in
            # the hits' one copy (post.compact_dense_begin). Nothing below waits for the GPU, so
            # every index list of the chunk goes to the GPU in one copy
            for k, (row, task, positions) in enumerate(records):
                if len(positions) > 1:
                    counted.append((row, task, positions, 1))
                    counted_records.append(k)
            layout = self._dense_layout(batch, counted, counted_records, slots, len(records)) if counted else None
            if layout is not None and self.graphs is not None and t_min is not None:
                from manylora.post import dtype_floor

                done = self.graphs.run(hidden, batch, records, count_slots, layout, t_min, dtype_floor)
                if done is not None:
                    scores, mask, counts = done
                    plan["counts"] = (counts, [(row, task) for row, task, _ in records])
                    plan["rows"] = layout["plan_rows"]
                    plan["graphed"] = (scores, mask)
                    return None, plan
            on_device = device_lists(list(prompts) + (layout["lists"] if layout else []), device)
        else:
            on_device = device_lists(list(prompts), device)
        prompt_rows, prompt_pos, count_slots_t = on_device[:3]
        with self._set(("count_pred",), rows=count_slots, rows_on_device=count_slots_t):
            count_out = model.count_pred(hidden[prompt_rows, prompt_pos]).argmax(dim=-1)
        if gated:
            plan["counts"] = (count_out, [(row, task) for row, task, _ in records])
            lists = on_device[3:]
        else:
            for k, ((row, task, positions), count) in enumerate(zip(records, count_out.tolist())):
                pred_counts[row][task] = int(count)
                if count > 0 and len(positions) > 1:
                    counted.append((row, task, positions, int(count)))
                    counted_records.append(k)
            layout = self._dense_layout(batch, counted, counted_records, slots, None) if counted else None
            lists = device_lists(layout["lists"], device) if layout else []
        if layout is None:
            return None, plan
        # the layout's lists on the device, in _dense_layout's order
        field_rows, field_pos, field_slots, active_t, span_slots, lengths = lists[:6]
        flat_dest, source = (lists[6], lists[7]) if layout["flat_dest"] is not None else (None, None)
        gate_index = lists[-1] if gated else None
        plan["rows"] = layout["plan_rows"]
        initial = hidden[field_rows, field_pos]
        projected = self._count_embed_flat(
            layout["steps"], initial, layout["field_slots"], field_slots
        )  # [longest, sum M, H]
        longest, total_fields = projected.shape[0], projected.shape[1]
        active, width_q = layout["active"], layout["width_q"]
        hidden_size = hidden.shape[-1]
        flat = projected.reshape(longest * total_fields, hidden_size)
        if flat_dest is None:
            # one instance per task and as many queries in every row: the queries are the
            # projections in order (source is 0, 1, ...: fields are numbered in row and task order)
            queries = flat.view(len(active), width_q, hidden_size)
        else:
            queries = torch.zeros(len(active) * width_q, hidden_size, device=device, dtype=hidden.dtype)
            queries[flat_dest] = flat[source]
            queries = queries.reshape(len(active), width_q, hidden_size)
        if gated:  # [A, Q]: whether each query's task has a count above 0 (padding: False)
            plan["query_gate"] = query_gate(count_out, gate_index).view(len(active), width_q)
        max_words = layout["max_words"]
        word_index = batch.text_word_indices[:, :max_words].to(device)[active_t]
        word_mask = batch.text_word_mask[:, :max_words].to(device)[active_t]
        tokens = hidden[active_t.unsqueeze(1), word_index]
        tokens = torch.where(word_mask.unsqueeze(-1), tokens, torch.zeros((), dtype=tokens.dtype, device=device))
        with self._set(("span_rep",), rows=layout["span_slots"], rows_on_device=span_slots):
            logits = self._span_scores(tokens, queries, lengths)
        return logits, plan

    def _dense_layout(self, batch, counted, counted_records, slots, n_records: Optional[int]) -> dict:
        """The host side of ``span_logits_dense`` after the counts: where each field's embedding
        is, each query's place in the padded [A, Q] queries, the active rows and their slots and
        word counts. ``lists`` holds the index lists for the GPU, in this order: field rows,
        field positions, field slots, active rows, their slots, their word counts, then (when
        the queries need a scatter) destinations and sources, then, for the count gate (``n_records``
        given: the records' count), each padded query's task as its index in the records
        (``n_records`` for padding)."""
        from gliner2.layers import CountLSTM

        embed = self.model.count_embed
        if type(embed) is not CountLSTM:
            raise NotImplementedError("dense heads need GLiNER2's CountLSTM")
        words = batch.text_word_counts
        steps = [min(count, embed.max_count) for _, _, _, count in counted]
        longest = max(steps)
        field_rows = [row for row, _, positions, _ in counted for _ in positions[1:]]
        field_pos = [pos for _, _, positions, _ in counted for pos in positions[1:]]
        field_slots = [slots[row] for row, _, positions, _ in counted for _ in positions[1:]]
        total_fields = len(field_rows)
        # queries of each row in GLiNER2's order: its span tasks in task order, each as
        # [instances, fields] flattened (entities keep instance 0 only)
        by_row: dict[int, list] = {}
        offset = 0
        for (row, task, positions, _), count, record in zip(counted, steps, counted_records):
            fields = len(positions) - 1
            instances = 1 if batch.task_types[row][task] == "entities" else count
            by_row.setdefault(row, []).append((task, instances, fields, offset, record))
            offset += fields
        active = sorted(by_row)
        per_row, source, query_records, plan_rows = [], [], [], []  # query_records: each query's task (records index)
        for row in active:
            q = 0
            tasks = []
            for task, instances, fields, field_offset, record in by_row[row]:
                tasks.append((task, q, instances, fields))
                for i in range(instances):
                    start = i * total_fields + field_offset
                    source.extend(range(start, start + fields))
                query_records.extend([record] * (instances * fields))
                q += instances * fields
            per_row.append(q)
            plan_rows.append((row, words[row], tasks))
        width_q = max(per_row)
        flat_dest = None
        if not (longest == 1 and all(q == width_q for q in per_row)):
            flat_dest = []
            for a, q in enumerate(per_row):
                flat_dest.extend(range(a * width_q, a * width_q + q))
        lengths = [words[row] for row in active]
        span_slots = [slots[row] for row in active]
        lists = [field_rows, field_pos, field_slots, active, span_slots, lengths]
        if flat_dest is not None:
            lists += [flat_dest, source]
        if n_records is not None:  # the count gate's index
            gate_index = query_records
            if flat_dest is not None:
                gate_index = [n_records] * (len(active) * width_q)
                for dest, record in zip(flat_dest, query_records):
                    gate_index[dest] = record
            lists.append(gate_index)
        return {
            "lists": lists,
            "steps": steps,
            "field_slots": field_slots,
            "span_slots": span_slots,
            "active": active,
            "width_q": width_q,
            "flat_dest": flat_dest,
            "plan_rows": plan_rows,
            "max_words": max(lengths),
        }

    def _span_scores(self, tokens: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """GLiNER2's ``_compute_span_scores_core(tokens, queries, lengths, mask_invalid=True)``; with
        ``span_kernel`` on, the same values from ``fused_span_scores`` (one kernel, no span tensor)."""
        layer = fusable_span_layer(self.model) if self.span_kernel else None
        if layer is None:
            return self.model._compute_span_scores_core(tokens, queries, lengths, mask_invalid=True)
        return fused_span_scores(layer, tokens, queries, lengths)

    def _count_embed_flat(
        self, steps: list[int], initial: torch.Tensor, field_slots: list[int], on_device: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """GLiNER2's CountLSTM for every task at once, on their gathered field embeddings
        ``initial`` [sum M, H] (tasks in order), each field with its row's slot
        (``field_slots``; ``on_device``: the same on the GPU, if already there): the
        [max(steps), sum M, H] projections, of which each task keeps its own first steps."""
        with self._set(("count_embed",), rows=field_slots, rows_on_device=on_device):
            return self.count_embed_steps(max(steps), initial)

    def count_embed_steps(self, longest: int, initial: torch.Tensor) -> torch.Tensor:
        """GLiNER2's CountLSTM over ``longest`` steps for the field embeddings ``initial`` [M, H],
        with the head LoRA the caller set on ``count_embed``: [longest, M, H]."""
        embed = self.model.count_embed
        positions = embed.pos_embedding(torch.arange(longest, device=initial.device))
        states = embed.gru(positions.unsqueeze(1).expand(longest, initial.shape[0], initial.shape[1]), initial)
        joined = torch.cat([states, initial.unsqueeze(0).expand_as(states)], dim=-1).transpose(0, 1)
        return embed.projector(joined).transpose(0, 1)  # [longest, M, H]

    def classification_probabilities(self, batch, all_schema_embs) -> list[list[Optional[torch.Tensor]]]:
        """Each (row, classification task)'s class probabilities, each row with its own head LoRA
        (None where GLiNER2 computes none). Same computation as GLiNER2's
        ``_compute_classification_probabilities`` at temperature 1: the classifier on the label
        markers' embeddings, then softmax or sigmoid as the task's config resolves."""
        slots = self.row_slots if self.row_slots is not None else [-1] * len(batch)
        out: list[list[Optional[torch.Tensor]]] = []
        for row, tasks in enumerate(batch.task_types):
            probs: list[Optional[torch.Tensor]] = [None] * len(tasks)
            for task, task_type in enumerate(tasks):
                tokens = batch.schema_tokens_list[row][task]
                embeddings = all_schema_embs[row][task] if task < len(all_schema_embs[row]) else []
                if task_type != "classifications" or len(tokens) < 4 or not embeddings:
                    continue
                config = classification_config(tokens[2], batch.original_schemas[row].get("classifications", []))
                if config is None:
                    continue
                with self._set(("classifier",), single=slots[row]):
                    logits = self.model.classifier(torch.stack(embeddings)[1:]).squeeze(-1) / 1.0
                activation = config.get("class_act", "auto")
                sigmoid = activation == "sigmoid" or (activation == "auto" and config.get("multi_label", False))
                probs[task] = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
            out.append(probs)
        return out

    def _count_embed(self, counted, slots) -> list[torch.Tensor]:
        """``count_embed(fields, count)`` for every (row, task) of ``counted``, one [count, M, H] each.

        GLiNER2's CountLSTM runs a GRU whose rows (fields) never interact, from the field
        embeddings over learned count positions, then a projector MLP. All tasks of the
        batch run as one GRU over the largest count and one projector call (each field row
        with its own adapter), then every task keeps its own first ``count`` steps: the same
        values as one call per task, with two launches per step instead of a few dozen per task.
        """
        from gliner2.layers import CountLSTM

        embed = self.model.count_embed
        if not counted:
            return []
        if type(embed) is not CountLSTM:  # other counting layers: one call per task
            out = []
            for row, _, embeddings, count in counted:
                with self._set(("count_embed",), single=slots[row]):
                    out.append(embed(embeddings[1:], count))
            return out
        fields = [embeddings[1:] for _, _, embeddings, _ in counted]
        steps = [min(count, embed.max_count) for _, _, _, count in counted]
        field_slots = [slots[row] for (row, _, _, _), f in zip(counted, fields) for _ in range(f.shape[0])]
        projected = self._count_embed_flat(steps, torch.cat(fields), field_slots)  # [longest, sum M, H]
        out, start = [], 0
        for f, count in zip(fields, steps):
            out.append(projected[:count, start : start + f.shape[0]])
            start += f.shape[0]
        return out


def query_gate(counts: torch.Tensor, gate_index: torch.Tensor) -> torch.Tensor:
    """Whether each padded query's task has a count above 0: ``gate_index`` holds each query's
    task as its index in ``counts`` (the records' counts), ``len(counts)`` for padding (never)."""
    return torch.cat([counts, counts.new_zeros(1)])[gate_index] > 0


def classification_config(prompt: str, classifications: Sequence[dict]) -> Optional[dict]:
    """The classification task config a schema prompt belongs to, as GLiNER2 resolves it: the
    longest task name the prompt starts with and that is followed by nothing, ':' or ' ';
    failing that, the first task name the prompt starts with."""
    best = None
    for config in classifications:
        task = config.get("task", "")
        if task and prompt.startswith(task):
            rest = prompt[len(task) :]
            if (rest == "" or rest[0] in (":", " ")) and (best is None or len(task) > len(best.get("task", ""))):
                best = config
    if best is None:
        best = next((c for c in classifications if prompt.startswith(c.get("task", ""))), None)
    return best


def _span_tasks(specials, types, tokens, count: int) -> list[tuple[int, list]]:
    """A schema's span tasks that GLiNER2 scores: (task, positions of its prompt and fields), for
    tasks that are not classifications, have positions and a span marker in their tokens."""
    out = []
    for task, task_type in enumerate(types):
        if task_type == "classifications" or task >= count:
            continue
        positions, task_tokens = specials[task], tokens[task]
        if not positions or len(task_tokens) < 4:
            continue
        if not any(task_tokens[j] in SPAN_TASK_MARKERS for j in range(len(task_tokens) - 1)):
            continue
        out.append((task, positions))
    return out


def fusable_span_layer(model: nn.Module):
    """GLiNER2's span layer when it has the form ``fused_span_scores`` computes (``SpanMarkerV0``
    with ``out_project`` = Linear, ReLU, Dropout, Linear, in eval mode), else None."""
    from gliner2.layers import SpanMarkerV0

    layer = getattr(getattr(model, "span_rep", None), "span_rep_layer", None)
    if not isinstance(layer, SpanMarkerV0) or layer.training:
        return None
    out = layer.out_project
    if len(out) != 4 or not isinstance(out[1], nn.ReLU) or not isinstance(out[2], nn.Dropout):
        return None
    if not all(hasattr(out[i], "weight") and hasattr(out[i], "bias") for i in (0, 3)):
        return None
    return layer


def fused_span_scores(layer, h: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``layer.score_queries(h, queries, lengths, mask_invalid=True)`` (GLiNER2's factorised span
    head: [B, Q, L, max_width] logits, -inf for spans past a row's words) with the span tensor
    never built: the token-level projections as GLiNER2 runs them (through the modules, so each
    row's head LoRA applies), then ``kernels.span_scores`` for the spans. GLiNER2 materialises
    [B, L, max_width, 4H] in three elementwise passes before its batched GEMM (kernels/spanscores.py)."""
    from manylora import kernels

    hidden = h.shape[-1]
    first, final = layer.out_project[0], layer.out_project[3]
    # as score_queries: ReLU(cat(start, end)) through the first layer's two halves, per token
    start = torch.nn.functional.linear(layer.project_start(h).relu(), first.weight[:, :hidden], None)
    end = torch.nn.functional.linear(layer.project_end(h).relu(), first.weight[:, hidden:], None)
    folded = torch.matmul(queries, final.weight)  # q^T (W2 d + b2) = (q^T W2) d + q^T b2
    query_bias = None if final.bias is None else torch.matmul(queries, final.bias)
    return kernels.span_scores(start, end, first.bias, folded, query_bias, lengths, layer.max_width)


@torch.no_grad()
def check_span_kernel(model: nn.Module, seed: int = 0) -> str:
    """``fused_span_scores`` against GLiNER2's own ``score_queries`` on a few random rows of this
    model's span layer, on its device and dtype (the load-time check of the span kernel). Returns
    "" when they agree (the same -inf spans; finite logits within two steps of the dtype at the
    largest logit's scale, for the dot's other summation order; float32 within 1e-5 of that
    scale), else what went wrong."""
    layer = fusable_span_layer(model)
    if layer is None:
        return "the checkpoint's span head is not GLiNER2's SpanMarkerV0 form (Linear, ReLU, Dropout, Linear)"
    weight = layer.out_project[3].weight
    device, dtype, hidden = weight.device, weight.dtype, weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    # (rows, words, queries, each row's words): one query tile, then two (more than 64 queries)
    for rows, words, num_q, lengths in ((3, 37, 21, [37, 16, 1]), (2, 9, 70, [9, 5])):
        h = torch.randn(rows, words, hidden, generator=gen).to(device, dtype)
        queries = torch.randn(rows, num_q, hidden, generator=gen).to(device, dtype)
        lengths = torch.tensor(lengths, device=device)
        want = layer.score_queries(h, queries, lengths, mask_invalid=True)
        try:
            got = fused_span_scores(layer, h, queries, lengths)
        except Exception as exc:
            return f"the span kernel failed: {type(exc).__name__}: {exc}"
        finite = torch.isfinite(want)
        if got.shape != want.shape or not torch.equal(torch.isfinite(got), finite):
            return "the span kernel's masked spans differ from GLiNER2's"
        step = max(2 * torch.finfo(dtype).eps, 1e-5)  # two steps of the dtype (float32: summation order)
        scale = float(want[finite].abs().max()) if finite.any() else 0.0
        worst = float((got[finite].float() - want[finite].float()).abs().max()) if finite.any() else 0.0
        if not worst <= step * max(scale, 1.0):
            return f"the span kernel's logits differ from GLiNER2's by up to {worst:.3g} (logits up to {scale:.3g})"
    return ""
