"""`SpiderTask`: Spider text-to-SQL as a `CalibrationTask` (decode stage only).

A case is a `SpiderEntry` (`load_spider`). It is generated as `generate_sql` generates it — `sql_prompt` (the
database's ``CREATE TABLE`` statements and the question), `sql_processor` (the database's xgrammar SQL grammar in the
policy's tag view), one `generate_structured` call — and scored by Spider's official exact-set match
(`exact_match`; a reply cut by the cap is the evaluator's empty query). `generate` composes those pieces instead of
calling `generate_sql` because calibration generates under policies that are not tables (a decode intervention is a
`BucketIntervention`), which `generate_sql` refuses; with a ``"sql"`` `PolicyTable` the two give the same
generation (tested).

Decode only: the prefill companion's keys are the tool-schema span labels of Table 6 (`label_prompt`), and a DDL
schema has no such spans (its text would all be ``protected_content``), nor does `generate_sql` take a prefill policy
to serve one. `prompt_labels` raises, and `calibrate` refuses the prefill stage for this task.
"""

from __future__ import annotations

from types import MappingProxyType

from ..eval.spider import SpiderEntry, database_schema, spider_tables
from ..eval.spider_evaluator import exact_match
from ..sql_generation import sql_processor, sql_prompt
from ..structure.processor import StructuralLogitsProcessor
from ..structured_generation import StructuredOutput, generate_structured, left_padded_batch
from .task import CalibrationTask

__all__ = ["SpiderTask"]


class SpiderTask(CalibrationTask):
    """Spider dev text-to-SQL, exact-set match (module docstring). Cases are named ``spider_dev_<index>`` and grouped
    by database (`category` = ``db_id``)."""

    name = "Spider"
    family = "sql"
    labels_prompts = False
    cache_key = MappingProxyType({"task": "spider"})
    case_type = SpiderEntry
    case_source = "load_spider"

    def case_id(self, case: SpiderEntry) -> str:
        return f"spider_dev_{case.index}"

    def category(self, case: SpiderEntry) -> str:
        return case.db_id

    def generate(
        self, model, tokenizer, case: SpiderEntry, policy, max_new_tokens, prefill_plan=None, prefill_policy=None
    ) -> StructuredOutput:
        if prefill_policy is not None:
            raise ValueError("the Spider task is decode-only: it takes no prefill_policy (module docstring)")
        batch = left_padded_batch(
            tokenizer, [sql_prompt(tokenizer, case.question, database_schema(case.db_id))], model.device
        )
        processor = self.processor(tokenizer, case, policy)
        return generate_structured(
            model, tokenizer, batch, processor, policy, max_new_tokens, prefill_plan=prefill_plan
        )

    def processor(self, tokenizer, case: SpiderEntry, policy) -> StructuralLogitsProcessor:
        return sql_processor(tokenizer, database_schema(case.db_id), policy)

    def score(self, case: SpiderEntry, text: str, stopped: bool) -> bool:
        """Official exact-set match of the query (``text`` stripped; ``None`` when not ``stopped``, as
        `generate_sql` reports a cut query) against the gold query."""
        predicted = text.strip() if stopped else None
        return bool(exact_match(case.gold, predicted, spider_tables()[case.db_id])["exact"])

    def prompt_labels(self, tokenizer, case: SpiderEntry) -> list[tuple[str, ...]]:
        raise ValueError(
            "Spider prompts have no span labels (the prefill labels of Table 6 mark tool schemas; a DDL schema has "
            "none): the Spider task calibrates the decode table only, stages=('decode',)"
        )
