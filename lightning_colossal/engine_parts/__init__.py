"""The parts the engines (zero/, gemini/, fsdp/, parallel/) are built from and share, so that no engine imports
another: which rows each rank owns (``rows``), the copies into and out of staging buffers (``staging``), name-keyed
sharded optimizer state and global-norm clipping, with the clipping methods ZeRO and Gemini share
(``sharded_state``), taking over the user's optimizer (``optimizer_takeover``), values for models built on the meta
device (``meta_init``, ``pretrained``), walks of the autograd graph (``autograd_graph``), running statistics kept
equal across replicas (``running_statistics``), whole parameters read outside a forward (``whole_parameters``), a
running average of the weights in their own pieces (``weight_average``), large host buffers kept for the next step
(``buffer_pool``), the stand-ins through which a checkpoint reads and fills tensors one at a time (``stand_ins``) and
the attached techniques shown in ``print(model)`` (``shown_techniques``).

Plain torch, no Lightning, no engine. Communication is not here: these modules call collectives only through
``lightning_colossal.distributed``. Import the modules themselves; this package exports nothing.
"""
