"""Long-context evaluations: loss / perplexity by position, passkey retrieval, needle-in-a-haystack
(depth × length grid, heatmaps), RULER-style synthetic tasks with RULER's scoring, and an
lm-evaluation-harness adapter (``ringsplash.evals.lm_eval_adapter``, needs ``lm-eval``).
Nothing here downloads anything: haystacks and tasks are built from local text.

CLI: ``python -m ringsplash.evals {loss,passkey,niah,ruler} --model DIR ...`` (docs/evals.md).
"""

from ringsplash.evals.grid import METRICS, grid_table, run_grid, summarize, write_grid
from ringsplash.evals.haystack import Haystack, default_text, read_text
from ringsplash.evals.loading import inference_generate_fn, load_model, single_device
from ringsplash.evals.loss_by_position import (
    LossByPosition,
    bucket_edges,
    document_rows,
    loss_by_position,
    write_loss_by_position,
)
from ringsplash.evals.needle import NeedleTask, niah_task, passkey_task, token_passkey_task
from ringsplash.evals.ruler import (
    RULER_TASKS,
    postprocess_pred,
    ruler_samples,
    run_ruler,
    score_predictions_file,
    string_match_all,
    string_match_part,
)
from ringsplash.evals.scoring import GenerateFn, Scorer, TokenScores
from ringsplash.evals.tokenizer import BytesTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "METRICS",
    "RULER_TASKS",
    "BytesTokenizer",
    "GenerateFn",
    "HFTokenizer",
    "Haystack",
    "LossByPosition",
    "NeedleTask",
    "Scorer",
    "TokenScores",
    "Tokenizer",
    "bucket_edges",
    "default_text",
    "document_rows",
    "grid_table",
    "inference_generate_fn",
    "load_model",
    "load_tokenizer",
    "loss_by_position",
    "niah_task",
    "passkey_task",
    "postprocess_pred",
    "read_text",
    "ruler_samples",
    "run_grid",
    "run_ruler",
    "score_predictions_file",
    "single_device",
    "string_match_all",
    "string_match_part",
    "summarize",
    "token_passkey_task",
    "write_grid",
    "write_loss_by_position",
]
