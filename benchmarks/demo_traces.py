"""Real routing traces of the embedded demo pair, for the offload benchmarks.

`demo_traces(documents, tokens)` routes held-out standard-library sources (real text, never
trained on) through the demo target, teacher-forced, and beside each trace the routing of the
tokens a real draft would have proposed there: the demo draft's greedy prediction at every
position (teacher-forced on the same text), routed by the target as a sequence of its own. The
second array is what the simulator uses for rejected drafts (`rejected_routing`): the routing of
tokens the draft wrote, not of the accepted continuation. An approximation: a rejected draft's
prefix in the pass is the real text, here the draft's own predictions.
"""

import numpy as np
import torch

from moespec.demo import demo_paths
from moespec.demo.corpus import held_out_documents
from moespec.models import load_model
from moespec.routing import RoutingTrace
from moespec.routing.record import model_header, record_routing, tokenize_documents


def demo_traces(documents: int = 4, tokens: int = 256):
    """[(RoutingTrace of the text, rejected routing [T, L, m])] for `documents` held-out files."""
    target_dir, draft_dir = demo_paths()
    target, tokenizer = load_model(target_dir, dtype="fp32", pack=False)
    draft, _ = load_model(draft_dir, dtype="fp32", pack=False)
    texts = tokenize_documents(tokenizer, held_out_documents(documents * 4, max_chars=tokens * 8))
    texts = [(name, ids[:tokens]) for name, ids in texts if len(ids) >= tokens][:documents]
    header = model_header(target)
    out = []
    for name, ids in texts:
        proposals = draft_predictions(draft, ids)
        routed = record_routing(target, [(name, ids), (name + "#draft", proposals)], kernel="slot")
        (text, drafted) = list(routed)
        out.append((one_document_trace(text.expert_ids, name, header), drafted.expert_ids))
    return out


def draft_predictions(draft, ids: list[int]) -> list[int]:
    """The draft's greedy next token at each position, teacher-forced (the first is kept)."""
    cache = draft.new_cache(capacity=len(ids))
    logits = draft(torch.tensor(ids), cache, all_logits=True)[0]  # [T, V]
    return [ids[0], *logits[:-1].argmax(-1).tolist()]


def one_document_trace(expert_ids, name: str, header: dict) -> RoutingTrace:
    ids = np.asarray(expert_ids, dtype=np.int64)
    return RoutingTrace(
        ids,
        [0, len(ids)],
        [name],
        header["num_experts"],
        header["expert_bytes"],
        header["layer_indices"],
        model=header["model"],
    )
