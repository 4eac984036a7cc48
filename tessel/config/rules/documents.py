"""Packed documents (model.document_separator, tessel.models.documents): the reference GPT's forward finds the
documents in its token ids and hands every block the mask. The layouts whose attention does not see those ids
whole are refused by name; the separator against data.tokenizer's is checked with the data
(tessel.train.data.validate_data)."""

from __future__ import annotations

from tessel.config.rule import Rule


def _documents(c) -> bool:
    return c.model.document_separator is not None


RULES = [
    Rule("model.document_separator", lambda c: c.parallel.pp == 1, "packed documents under a pipeline (pp > 1) "
         "are not built: the stages after the first receive hidden states, not the token ids the documents are "
         "read from; set pp = 1", when=_documents),
    Rule("model.document_separator", lambda c: c.parallel.cp == 1, "packed documents under context parallelism "
         "(cp > 1) are not built: ring and Ulysses attention would need each chunk's document ids; set cp = 1",
         when=_documents),
    Rule("model.document_separator", lambda c: c.parallel.tp == 1 or c.parallel.tp_mode == "1d",
         lambda c: f"packed documents under tp_mode {c.parallel.tp_mode!r} are not built: the grid splits each "
         "batch into chunks, the mask is made for the whole batch; use tp_mode '1d'", when=_documents),
]
