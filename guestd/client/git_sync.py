"""Blocking twin of :mod:`guestd.client.git` (``Client.git``): the same methods, run on the
client's loop thread."""

from __future__ import annotations

from guestd.client._blocking import GitBase
from guestd.client.git import GitCommit, GitDiff, GitStatus


class Git(GitBase):
    """git in the guest for a :class:`~guestd.client.Client`; see :class:`AsyncGit`."""

    def status(self, repo: str, *, timeout_s: float | None = None) -> GitStatus:
        return self.client._run(self.aio.status(repo, timeout_s=timeout_s))

    def changed_files(self, repo: str, *, timeout_s: float | None = None) -> list[str]:
        return self.client._run(self.aio.changed_files(repo, timeout_s=timeout_s))

    def diff(
        self,
        repo: str,
        *paths: str,
        staged: bool = False,
        base: str | None = None,
        context_lines: int | None = None,
        max_output: int | None = None,
        timeout_s: float | None = None,
    ) -> GitDiff:
        return self.client._run(
            self.aio.diff(
                repo,
                *paths,
                staged=staged,
                base=base,
                context_lines=context_lines,
                max_output=max_output,
                timeout_s=timeout_s,
            )
        )

    def add(self, repo: str, paths: list[str] | None = None, *, timeout_s: float | None = None) -> None:
        self.client._run(self.aio.add(repo, paths, timeout_s=timeout_s))

    def commit(
        self,
        repo: str,
        message: str,
        *,
        add_all: bool = False,
        author_name: str | None = None,
        author_email: str | None = None,
        allow_empty: bool = False,
        timeout_s: float | None = None,
    ) -> GitCommit:
        return self.client._run(
            self.aio.commit(
                repo,
                message,
                add_all=add_all,
                author_name=author_name,
                author_email=author_email,
                allow_empty=allow_empty,
                timeout_s=timeout_s,
            )
        )
