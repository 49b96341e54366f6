"""Fixtures shared by the Dorylus tests: the local AWS stand-ins (see ``aws_services``)."""

from tests.dorylus.aws_services import aws_env, handler_zip, lambda_endpoint, s3_endpoint

__all__ = ["aws_env", "handler_zip", "lambda_endpoint", "s3_endpoint"]
