"""Triton Python-backend entry point of the adapter control model: a thin shell around
manylora.control (all logic, config parsing and the command protocol live there)."""

import triton_python_backend_utils as pb_utils

from manylora.control import ControlModelHandler


class TritonPythonModel:
    def initialize(self, args):
        self.handler = ControlModelHandler(args, pb_utils)

    def execute(self, requests):
        return self.handler.execute(requests)
