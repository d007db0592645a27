"""Triton Python-backend entry point: a thin shell around manylora.serving.

All logic (config parsing, request decoding, batching, inference, per-request errors)
lives in the installed ``manylora`` package.
"""

import triton_python_backend_utils as pb_utils

from manylora.serving import TritonModelHandler


class TritonPythonModel:
    def initialize(self, args):
        self.handler = TritonModelHandler(args, pb_utils)

    def execute(self, requests):
        return self.handler.execute(requests)

    def finalize(self):
        self.handler.finalize()
