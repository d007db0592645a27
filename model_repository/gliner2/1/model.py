"""Triton Python-backend entry point of the public gliner2 model: a thin shell around
manylora.serving.

With its ``core_model`` parameter set (the committed repository), each instance is a CPU
front (pre and post) that sends each batch's rows to the GPU stage in one BLS call. All logic (config parsing, request
decoding, per-request errors) lives in the installed ``manylora`` package.
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
