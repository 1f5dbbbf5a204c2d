"""RAN with other libraries and formats: PEFT's LoRA (`lora`), sentence-transformers (`sentence_embeddings`), ONNX
(`onnx_export`), the official `rannet` checkpoints (`convert_rannet`; their variables read by `rannet_checkpoint`), the
renaming of weights saved under an older layout (`rename_cell_weights`), a tokenizer's (source, target) pair laid out
as the prefix LM reads it (`seq2seq_features`) and Transformers' pipelines: extractive question answering
(`question_answering`).

Not modeling code: no modeling module imports it. A saved question-answering model's folder carries the pipeline's
module beside its own (files/saved_code.py), which imports torch and Transformers alone. Nothing is imported
here, so that importing one module (`from ran_hf.integrations.lora import ran_lora_config`) costs that module alone.
"""
