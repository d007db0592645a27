"""Triton Python-backend entry point of gliner2_core, the pipeline's GPU stage: a thin shell
around manylora.serving.core_handler (the encoder with every row's LoRA, the heads, and
the compact per-row answer the gliner2 front decodes)."""

import triton_python_backend_utils as pb_utils

from manylora.serving import core_handler


class TritonPythonModel:
    def initialize(self, args):
        self.handler = core_handler(args, pb_utils)

    def execute(self, requests):
        return self.handler.execute(requests)

    def finalize(self):
        self.handler.finalize()
