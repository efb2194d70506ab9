"""`aici-batch publish` and `aici-batch pull`: controllers as OCI artifacts (thin: the
work is in `aici_cli.control.registry`)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import click

PLAIN_HTTP_HELP = ("Talk to the registry over plain HTTP instead of HTTPS (a local or "
                   "in-cluster registry without TLS); never the default.")


def plain_http_option(f: Any) -> Any:
    return click.option("--plain-http", is_flag=True, envvar="AICI_BATCH_PLAIN_HTTP",
                        show_envvar=True, help=PLAIN_HTTP_HELP)(f)


def credential_options(f: Any) -> Any:
    f = click.option("--password-stdin", is_flag=True,
                     help="Read the registry password (or token) from standard input; "
                          "with --username.")(f)
    return click.option("--username", default=None,
                        help="Registry user name (the password comes from --password-stdin;"
                             " without both, the Docker config's credentials are used).")(f)


def _credentials(username: str | None, password_stdin: bool) -> Any:
    from aici_cli.cli.errors import FatalError
    from aici_cli.control.registry import Credentials

    if password_stdin and username is None:
        raise FatalError("--password-stdin goes with --username")
    if username is None:
        return None
    if not password_stdin:
        raise FatalError("--username needs --password-stdin: a password is never taken "
                         "from the command line")
    password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise FatalError("--password-stdin: standard input held no password")
    return Credentials(username, password)


@click.command()
@click.argument("component", type=click.Path(dir_okay=False))
@click.argument("ref", metavar="REF")
@credential_options
@plain_http_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def publish(component: str, ref: str, username: str | None, password_stdin: bool,
            plain_http: bool, as_json: bool) -> None:
    """Push a controller COMPONENT (.wasm, checked first) to an OCI registry as REF
    ([oci://]REGISTRY/NAME[:TAG], tag `latest` by default), in the CNCF wasm artifact
    layout, annotated with the WIT package and version it exports and the language,
    SDK and source digest `aici-batch build` recorded in it. Prints the digest to run it by.

    \b
    Examples:
      aici-batch publish yes_no.wasm ghcr.io/team/yes-no:1.0
      echo "$TOKEN" | aici-batch publish yes_no.wasm ghcr.io/team/yes-no:1.0 \\
          --username me --password-stdin
      aici-batch publish yes_no.wasm localhost:5000/yes-no:dev --plain-http
      aici-batch run prompts.jsonl --controller oci://ghcr.io/team/yes-no@sha256:...
    """
    from aici_cli.cli.errors import FatalError
    from aici_cli.control.registry import parse_ref
    from aici_cli.control.registry import publish as push
    from aici_cli.control.wasm.component_file import ComponentError
    from aici_cli.core.errors import UsageError

    credentials = _credentials(username, password_stdin)
    try:
        published = push(Path(component), parse_ref(ref), plain_http, credentials)
    except (UsageError, ComponentError) as e:
        raise FatalError(str(e)) from None
    if as_json:
        click.echo(json.dumps({"ref": str(published.ref), "digest": published.ref.digest,
                               "by_digest": published.ref.by_digest(),
                               "size": published.size,
                               "annotations": published.annotations}, indent=2))
        return
    click.echo(f"published {published.ref.name}:{published.ref.tag} "
               f"({published.size / 1e6:.1f} MB)", err=True)
    click.echo(published.ref.by_digest())


@click.command()
@click.argument("ref", metavar="REF")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Also copy the component here (it is always kept in the component "
                   "cache, keyed by digest).")
@credential_options
@plain_http_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def pull(ref: str, output: str | None, username: str | None, password_stdin: bool,
         plain_http: bool, as_json: bool) -> None:
    """Pull the controller REF ([oci://]REGISTRY/NAME:TAG or @sha256:...) into the
    component cache, checking every digest; later runs by digest need no network.
    Prints the reference by digest.

    \b
    Examples:
      aici-batch pull ghcr.io/team/yes-no:1.0
      aici-batch pull localhost:5000/yes-no:dev --plain-http -o yes_no.wasm
    """
    from aici_cli.cli.errors import FatalError
    from aici_cli.control.registry import parse_ref
    from aici_cli.control.registry import pull as fetch
    from aici_cli.core.errors import UsageError

    credentials = _credentials(username, password_stdin)
    try:
        pulled = fetch(parse_ref(ref), plain_http, credentials)
    except UsageError as e:
        raise FatalError(str(e)) from None
    if output is not None:
        try:
            shutil.copyfile(pulled.wasm, output)
        except OSError as e:
            raise FatalError(f"cannot write {output}: {e.strerror}") from None
    if as_json:
        click.echo(json.dumps({"ref": str(pulled.ref), "digest": pulled.ref.digest,
                               "by_digest": pulled.ref.by_digest(),
                               "path": str(pulled.wasm), "downloaded": pulled.downloaded,
                               "annotations": pulled.annotations,
                               "config": pulled.config}, indent=2))
        return
    where = "downloaded" if pulled.downloaded else "already cached"
    click.echo(f"{where}: {pulled.wasm}", err=True)
    click.echo(pulled.ref.by_digest())
