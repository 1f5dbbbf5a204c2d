"""RAN as a sentence-transformers embedding model, with RAN's own document representations.

`RANModel` computes four document representations; `pooling` picks one:

- `"cell_transform"`: `pooler_output`, the official cell transform `GLU(swish(Dense(cell))) + Dense(max of tokens)`
  (the "semantic feature" the authors use for document embeddings);
- `"pooled_cell"`: `pooled_cell`, the last layer's cells pooled by `config.cell_pooling` (the last cell by default);
- `"mean"` / `"max"`: the mean or max of the last layer's token states over the real tokens.

No module code of our own is needed, so nothing beyond RAN's model code has to be trusted: sentence-transformers'
`Transformer` module writes one output of the model under a feature name of its choice (`modality_config`'s
`method_output_name`, then `module_output_name`). The cell choices take `pooler_output` or `pooled_cell` straight to
`sentence_embedding`, computed by `RANModel` itself; the token choices take `last_hidden_state` to `token_embeddings`
and add sentence-transformers' `Pooling` (mean or max over the attention mask). A saved RAN folder therefore loads
with `SentenceTransformer(folder, trust_remote_code=True)` wherever sentence-transformers (>= 6) and Transformers are
installed, `ran_hf` or not: the RAN code travels in the folder, as for `AutoModel`. The choice is recorded in the
folder's `sentence_bert_config.json` (and `1_Pooling/config.json`), and survives `SentenceTransformer.save`.

RAN lays out its windows from each document's own length, so an embedding does not depend on the batch it is
encoded in, nor on padding, for any choice.

    from ran_hf.integrations.sentence_embeddings import write_sentence_transformers_config
    write_sentence_transformers_config("outputs/ran-classifier", pooling="cell_transform")
    model = SentenceTransformer("outputs/ran-classifier", trust_remote_code=True)

sentence-transformers is optional (`pip install ran-hf[embeddings]`): only `ran_sentence_transformer` and
`sentence_pooling` import it. Writing the files needs nothing beyond `ran_hf`'s own dependencies.
"""

import json
import os
from importlib import metadata
from pathlib import Path

from ..files.safe_writes import write_into


__all__ = [
    "SENTENCE_POOLINGS",
    "ran_sentence_transformer",
    "sentence_pooling",
    "sentence_transformers_files",
    "write_sentence_transformers_config",
]

SENTENCE_POOLINGS = ("cell_transform", "pooled_cell", "mean", "max")
"""The document representations a RAN sentence-transformers model can give (see the module docstring)."""

# The RANModel output each cell choice reads; the token choices read `last_hidden_state` and pool it.
CELL_OUTPUTS = {"cell_transform": "pooler_output", "pooled_cell": "pooled_cell"}
TRANSFORMER_TYPE = "sentence_transformers.base.modules.transformer.Transformer"
POOLING_TYPE = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
POOLING_FOLDER = "1_Pooling"
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
"""What `write_sentence_transformers_config` writes at the top of a folder (plus `1_Pooling/` for mean and max)."""


def check_pooling(pooling: str) -> str:
    if pooling not in SENTENCE_POOLINGS:
        raise ValueError(f"`pooling` must be one of {SENTENCE_POOLINGS}, got {pooling!r}.")
    return pooling


def transformer_config(pooling: str, max_seq_length: int | None = None) -> dict:
    """The `sentence_bert_config.json` of sentence-transformers' `Transformer` module for a pooling choice."""
    check_pooling(pooling)
    if pooling in CELL_OUTPUTS:
        method_output_name, module_output_name = CELL_OUTPUTS[pooling], "sentence_embedding"
    else:
        method_output_name, module_output_name = "last_hidden_state", "token_embeddings"
    config = {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": method_output_name}},
        "module_output_name": module_output_name,
    }
    if max_seq_length is not None:
        config["max_seq_length"] = max_seq_length
    return config


def sentence_transformers_files(pooling: str, hidden_size: int, max_seq_length: int | None = None) -> dict:
    """The sentence-transformers files for a pooling choice, as {relative path: JSON content}."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER_TYPE}]
    files = {"sentence_bert_config.json": transformer_config(pooling, max_seq_length)}
    if pooling not in CELL_OUTPUTS:
        modules.append({"idx": 1, "name": "1", "path": POOLING_FOLDER, "type": POOLING_TYPE})
        files[f"{POOLING_FOLDER}/config.json"] = {
            "embedding_dimension": hidden_size,
            "pooling_mode": pooling,
            "include_prompt": True,
        }
    files["modules.json"] = modules
    versions = {}
    for distribution, key in (("sentence-transformers", "sentence_transformers"), ("transformers", "transformers")):
        try:
            versions[key] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            pass
    files["config_sentence_transformers.json"] = {
        "__version__": versions,
        "model_type": "SentenceTransformer",
        "prompts": {"query": "", "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    return files


def write_sentence_transformers_config(
    folder: str | os.PathLike, pooling: str = "cell_transform", max_seq_length: int | None = None
) -> None:
    """Make a saved RAN folder (any head: a classifier, a masked LM, a converted checkpoint) load as a
    `SentenceTransformer(folder, trust_remote_code=True)` whose embedding is `pooling`.

    Writes `modules.json`, `sentence_bert_config.json`, `config_sentence_transformers.json` and, for `"mean"` and
    `"max"`, `1_Pooling/config.json`; a `1_Pooling/` left by an earlier token choice is removed. The weights, config
    and tokenizer are not touched, so the folder loads with `AutoModel*` and pipelines as before. The files are
    written apart and renamed into place (`ran_hf.safe_writes.write_into`): a name in the folder that links elsewhere
    is replaced, never written through. `max_seq_length` truncates inputs (default: the
    tokenizer's `model_max_length`; RAN itself has no limit).
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: save the RAN model there first.")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("model_type") != "ran":
        raise ValueError(f"{folder} holds a {config.get('model_type')!r} model, not a RAN (`model_type='ran'`).")
    if config.get("is_causal"):
        raise ValueError(f"{folder} holds a causal RAN; document embeddings need the bidirectional encoder.")
    if max_seq_length is not None and max_seq_length < 1:
        raise ValueError(f"`max_seq_length` must be positive, got {max_seq_length}.")
    if check_pooling(pooling) == "cell_transform" and not has_trained_pooler(folder):
        raise ValueError(
            f"{folder} holds no cell transform (the `pooler` weights): the masked LM and token classifier do not "
            "train one, and loading would give it new random weights on every load. Choose `pooled_cell`, `mean` or "
            "`max`, or fine-tune it as an embedding model first (scripts/sentence-embeddings/train_embeddings.py)."
        )
    files = sentence_transformers_files(pooling, config["hidden_size"], max_seq_length)
    # safe_writes.py: written apart, then moved in (no link followed); a cell choice drops a token choice's pooling
    with write_into(folder, superseded=lambda written: {POOLING_FOLDER} - written) as staging:
        for relative_path, content in files.items():
            path = staging / relative_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def has_trained_pooler(folder: Path) -> bool:
    """Whether the weights saved in `folder` include RAN's pooler (the cell transform)."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    elif (folder / "model.safetensors").is_file():
        try:
            with safe_open(folder / "model.safetensors", framework="pt") as weights:
                names = list(weights.keys())
        except SafetensorError as error:  # safetensors' message does not name the file
            raise OSError(
                f"{folder / 'model.safetensors'} is damaged or cut short ({error}): its weights cannot be read. Save, "
                "copy or download it again."
            ) from error
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors(.index.json): save the RAN model there first.")
    return any(name.startswith(("pooler.", "model.pooler.")) for name in names)


def ran_sentence_transformer(
    model_name_or_path: str | os.PathLike,
    pooling: str = "cell_transform",
    max_seq_length: int | None = None,
    trust_remote_code: bool = False,
    **kwargs,
):
    """A `SentenceTransformer` on the RAN at `model_name_or_path` (a folder or Hub id of any RAN head), with the
    embedding `pooling`, whatever the folder's own sentence-transformers files say. `model.save(path)` writes a
    folder that loads back with the same choice. Extra keyword arguments go to `SentenceTransformer` (`device`, ...).

    With `trust_remote_code=True` the RAN code is taken from the folder; otherwise `ran_hf` must be imported (it is,
    here) so that the Auto classes know RAN.
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    loading = {"trust_remote_code": trust_remote_code}
    transformer = Transformer(
        str(model_name_or_path),
        model_kwargs=loading,
        processor_kwargs=loading,
        config_kwargs=loading,
        **transformer_config(pooling, max_seq_length),
    )
    if getattr(transformer.model.config, "is_causal", False):
        raise ValueError("Document embeddings need the bidirectional RAN encoder, not a causal one.")
    modules = [transformer]
    if pooling not in CELL_OUTPUTS:
        modules.append(Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling))
    return SentenceTransformer(modules=modules, similarity_fn_name="cosine", **kwargs)


def sentence_pooling(model) -> str:
    """Which of `SENTENCE_POOLINGS` a RAN `SentenceTransformer` embeds with, read off its modules."""
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = list(model)
    if not modules or not isinstance(modules[0], Transformer):
        raise ValueError("Not a RAN sentence-transformers model: its first module is no `Transformer`.")
    output = modules[0].modality_config["text"]["method_output_name"]
    for pooling, cell_output in CELL_OUTPUTS.items():
        if output == cell_output and len(modules) == 1:
            return pooling
    if output == "last_hidden_state" and len(modules) == 2 and isinstance(modules[1], Pooling):
        if modules[1].pooling_mode in ("mean", "max"):
            return modules[1].pooling_mode
    raise ValueError(f"These modules are none of the RAN pooling choices {SENTENCE_POOLINGS}: {modules}.")
