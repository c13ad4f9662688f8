"""The optimizer: the user's as given (``spec``), stepped on the flat shards where it is one element-wise
optimizer with one group (``stepping``), else on whole parameters on owner ranks (``owners``); Adam
with its moments stored in bf16 (``low_precision_adam``) and Adam without bias correction
(``uncorrected_adam``, DeepSpeed's ``bias_correction: false``)."""
