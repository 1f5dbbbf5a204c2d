"""RAN with other libraries and formats: PEFT's LoRA (`lora`), sentence-transformers (`sentence_embeddings`), ONNX
(`onnx_export`), the official `rannet` checkpoints (`convert_rannet`) and the renaming of weights saved under an older
layout (`rename_cell_weights`).

Not modeling code: a saved model folder never carries it, and no modeling module imports it. Nothing is imported
here, so that importing one module (`from ran_hf.integrations.lora import ran_lora_config`) costs that module alone.
"""
