"""The suite's Hypothesis example databases, from --ua-database and
--ua-shared-database (ua-verify --database, --shared-database).

Each option takes a directory or a Redis URL (``redis://HOST:PORT/DB``,
``rediss://`` with TLS, ``unix:///path/to.sock?db=0``). Every test has a
local directory database of its own (Hypothesis keys a database by the test
function's source, which all the suite's tests share): ``DIR/<test id>`` of a
directory --ua-database, else ``.hypothesis/ua-examples/<test id>``. To it are
joined (MultiplexedDatabase: failures saved into every one, replayed from
all of them):

- a Redis URL (either option): Hypothesis's RedisExampleDatabase, read and
  written, its keys prefixed ``ua-examples:<impl>:<test id>:``. Campaigns on
  several hosts given the same URL each replay the failures the others saved.
  A saved failure that passes where it is replayed is deleted (Hypothesis's
  reuse phase), hence the implementation in the key: a campaign of another
  implementation sharing the server leaves it alone;
- a directory --ua-shared-database: read only, ``DIR/<test id>``.

A Redis URL needs the ``redis`` package (``pip install
'unified-attention[redis]'``).
"""

from __future__ import annotations

import functools
import os
import urllib.parse

DEFAULT_ROOT = os.path.join(".hypothesis", "ua-examples")
REDIS_SCHEMES = ("redis", "rediss", "unix")
KEY_PREFIX = "ua-examples:"


class DatabaseOptionError(ValueError):
  """An option's database cannot be used; the message names the option."""


def is_url(value: str | None) -> bool:
  """Whether an option's value is a URL (else a directory)."""
  return bool(value) and "://" in value


def _check_url(option: str, url: str) -> None:
  scheme = url.split("://", 1)[0].lower()
  if scheme not in REDIS_SCHEMES:
    raise DatabaseOptionError(
        f"{option} {url}: not a directory nor a Redis URL "
        f"(redis://HOST:PORT/DB, rediss://HOST:PORT/DB or unix:///PATH?db=DB)")
  parts = urllib.parse.urlsplit(url)
  try:
    parts.port  # noqa: B018 -- raises on a port that is not a number in range
  except ValueError as exc:
    raise DatabaseOptionError(f"{option} {url}: malformed Redis URL ({exc})") from None
  if scheme == "unix":
    if not parts.path:
      raise DatabaseOptionError(f"{option} {url}: malformed Redis URL (no socket path)")
    return
  if not parts.hostname:
    raise DatabaseOptionError(f"{option} {url}: malformed Redis URL (no host)")
  db = parts.path.strip("/")
  if db and not db.isdigit():
    raise DatabaseOptionError(f"{option} {url}: malformed Redis URL "
                              f"(the database after the host must be a number, got {db!r})")


@functools.lru_cache(maxsize=None)
def _client(url: str):
  import redis
  return redis.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=60,
                              health_check_interval=30)


def redis_client(option: str, url: str):
  """The client of a Redis URL given to ``option`` (one per URL and process);
  DatabaseOptionError if the redis package is missing or the URL malformed.
  Connects to nothing."""
  _check_url(option, url)
  try:
    import redis  # noqa: F401
    import hypothesis.extra.redis  # noqa: F401
  except ImportError as exc:
    raise DatabaseOptionError(
        f"{option} {url}: a Redis example database needs the redis package "
        f"(pip install 'unified-attention[redis]'; {type(exc).__name__}: {exc})") from None
  try:
    return _client(url)
  except (ValueError, TypeError) as exc:
    raise DatabaseOptionError(f"{option} {url}: malformed Redis URL ({exc})") from None


def check_option(option: str, value: str | None) -> None:
  """Checks an option's value before anything runs: a Redis URL must parse,
  the redis package import and the server answer PING."""
  if not is_url(value):
    return
  client = redis_client(option, value)
  import redis
  try:
    client.ping()
  except redis.RedisError as exc:
    raise DatabaseOptionError(f"{option} {value}: the Redis server does not answer "
                              f"({type(exc).__name__}: {exc})") from None


def example_database(test_id: str, impl: str, database: str | None, shared: str | None,
                     options=("--ua-database", "--ua-shared-database")):
  """The example database of one test (see the module doc)."""
  from hypothesis.database import (DirectoryBasedExampleDatabase, MultiplexedDatabase,
                                   ReadOnlyDatabase)
  root = database if database and not is_url(database) else DEFAULT_ROOT
  parts = [DirectoryBasedExampleDatabase(os.path.join(root, test_id))]
  urls = []
  for option, value in zip(options, (database, shared)):
    if is_url(value) and value not in urls:
      from hypothesis.extra.redis import RedisExampleDatabase
      urls.append(value)
      parts.append(RedisExampleDatabase(redis_client(option, value),
                                        key_prefix=f"{KEY_PREFIX}{impl}:{test_id}:".encode()))
  if shared and not is_url(shared):
    parts.append(ReadOnlyDatabase(DirectoryBasedExampleDatabase(os.path.join(shared, test_id))))
  return parts[0] if len(parts) == 1 else MultiplexedDatabase(*parts)
