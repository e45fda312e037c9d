"""The ``neo serve`` command line's own flags (the engine's are ``neo.cli``'s) and the
``ServerSettings`` they make.

Every value is checked by the parser itself, so a mistake ends in argparse's one-line usage
error (exit status 2) before the model loads.
"""

import argparse
import os

from neo import cli_values

from .settings import ServerSettings

API_KEY_ENVIRONMENT_VARIABLE = "NEO_API_KEY"


def _non_empty(text: str) -> str:
    if not text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError(f"expected a non-empty printable name, got {text!r}")
    return text


def _api_key(text: str) -> str:
    if not text or not text.isascii() or not text.isprintable() or " " in text:
        raise argparse.ArgumentTypeError("the API key must be non-empty printable ASCII without "
                                         "spaces")
    return text


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP server's flags to ``parser``, each with its help and default."""
    defaults = ServerSettings()
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=defaults.host,
                       help="address to listen on (default: %(default)s; 0.0.0.0 for all)")
    group.add_argument("--port", type=cli_values.integer_at_least(1, 65535), default=defaults.port,
                       help="TCP port to listen on, 1..65535 (default: %(default)s)")
    group.add_argument("--served-model-name", type=_non_empty, default=None,
                       help="the model id clients see in /v1/models and send as 'model' "
                            "(default: the --model value)")
    environment_key = os.environ.get(API_KEY_ENVIRONMENT_VARIABLE) or None
    group.add_argument("--api-key", type=_api_key, default=environment_key,
                       help="require 'Authorization: Bearer <key>' on every route but /health "
                            f"and /metrics (default: the {API_KEY_ENVIRONMENT_VARIABLE} "
                            "environment variable, else no key)")
    group.add_argument("--max-request-body-bytes", type=cli_values.integer_at_least(1),
                       default=defaults.max_request_body_bytes,
                       help="refuse larger request bodies with 413 (default: 32 bytes per token "
                            "of the model's context, at least 1 MiB)")
    group.add_argument("--body-read-timeout", type=cli_values.positive_number,
                       default=defaults.body_read_timeout_seconds,
                       help="seconds a request body may take to arrive before 408 "
                            "(default: %(default)s)")
    group.add_argument("--keep-alive-timeout", type=cli_values.positive_number,
                       default=defaults.keep_alive_timeout_seconds,
                       help="seconds an idle keep-alive connection stays open "
                            "(default: %(default)s)")


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The ``ServerSettings`` of parsed ``add_server_arguments`` flags."""
    return ServerSettings(host=args.host, port=args.port,
                          served_model_name=args.served_model_name, api_key=args.api_key,
                          max_request_body_bytes=args.max_request_body_bytes,
                          body_read_timeout_seconds=args.body_read_timeout,
                          keep_alive_timeout_seconds=args.keep_alive_timeout)
