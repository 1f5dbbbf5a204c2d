"""Reading and writing the files around a model: training data (`data`, `labels`, `text_files`), output folders
(`folders`, with `folder_locks`, `recovery` and `paths`) and TensorFlow checkpoints (`tf_checkpoint`), for the
scripts, the converter (`ran_hf.integrations.convert_rannet`) and `export_onnx`; and the guarded writes of every save
(`safe_writes`), the code a saved folder ships (`saved_code`) and the weights files a load reads (`weight_files`).

Not modeling code: a saved model folder carries none of it but those last three, flat. Nothing is imported here, so
that importing one module (`from ran_hf.files.folders import write_folder`) costs that module and those it imports
alone.
"""
