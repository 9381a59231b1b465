"""The blocking client's workspace methods (see :mod:`guestd.client.workspace`), run on the client's loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import overload

from guestd.client._blocking import ClientBase
from guestd.client.replies import PatchedFile
from guestd.client.workspace import (
    DEFAULT_DEADLINE,
    Changes,
    EditResult,
    GlobResult,
    GrepEngine,
    GrepResult,
    Progress,
    TreeUpload,
    View,
)
from guestd.wire.paths import WirePath


class SyncWorkspaceAPI(ClientBase):
    """:class:`~guestd.client.Client`'s workspace methods."""

    def view(
        self,
        path: WirePath,
        *,
        start_line: int | None = None,
        end_line: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> View:
        return self._run(self._aio.view(path, start_line=start_line, end_line=end_line, deadline=deadline))

    def str_replace(
        self, path: WirePath, old: str, new: str, *, deadline: float | None = DEFAULT_DEADLINE
    ) -> EditResult:
        return self._run(self._aio.str_replace(path, old, new, deadline=deadline))

    def insert(self, path: WirePath, line: int, text: str, *, deadline: float | None = DEFAULT_DEADLINE) -> EditResult:
        return self._run(self._aio.insert(path, line, text, deadline=deadline))

    def replace_lines(
        self,
        path: WirePath,
        start_line: int,
        end_line: int,
        text: str,
        *,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> EditResult:
        return self._run(self._aio.replace_lines(path, start_line, end_line, text, deadline=deadline))

    def undo(self, path: WirePath, *, deadline: float | None = DEFAULT_DEADLINE) -> EditResult:
        return self._run(self._aio.undo(path, deadline=deadline))

    def apply_patch(
        self,
        path: WirePath,
        patch: bytes | str,
        *,
        strip: int | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> list[PatchedFile]:
        return self._run(self._aio.apply_patch(path, patch, strip=strip, deadline=deadline))

    def glob(
        self,
        path: WirePath,
        pattern: str,
        *,
        gitignore: bool | None = None,
        hidden: bool | None = None,
        max_results: int | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> GlobResult:
        return self._run(
            self._aio.glob(
                path,
                pattern,
                gitignore=gitignore,
                hidden=hidden,
                max_results=max_results,
                timeout_s=timeout_s,
                deadline=deadline,
            )
        )

    def grep(
        self,
        path: WirePath,
        pattern: str,
        *,
        literal: bool | None = None,
        ignore_case: bool | None = None,
        globs: list[str] | None = None,
        context: int | None = None,
        max_matches: int | None = None,
        gitignore: bool | None = None,
        hidden: bool | None = None,
        engine: GrepEngine | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> GrepResult:
        return self._run(
            self._aio.grep(
                path,
                pattern,
                literal=literal,
                ignore_case=ignore_case,
                globs=globs,
                context=context,
                max_matches=max_matches,
                gitignore=gitignore,
                hidden=hidden,
                engine=engine,
                timeout_s=timeout_s,
                deadline=deadline,
            )
        )

    def write_files(
        self,
        files: Mapping[WirePath, bytes | str],
        *,
        parents: bool | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> int:
        return self._run(self._aio.write_files(files, parents=parents, deadline=deadline))

    def upload_tree(
        self,
        src: str | bytes,
        dst: WirePath,
        *,
        replace: bool | None = None,
        parents: bool | None = None,
        exclude: list[str] | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> TreeUpload:
        return self._run(
            self._aio.upload_tree(
                src,
                dst,
                replace=replace,
                parents=parents,
                exclude=exclude,
                progress=progress,
                deadline=deadline,
                progress_timeout=progress_timeout,
            )
        )

    @overload
    def download_tree(
        self,
        src: WirePath,
        dst: None = None,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        gitignore: bool | None = None,
        max_bytes: int | None = None,
        chunk: int | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> bytes: ...

    @overload
    def download_tree(
        self,
        src: WirePath,
        dst: str,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        gitignore: bool | None = None,
        max_bytes: int | None = None,
        chunk: int | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> int: ...

    def download_tree(
        self,
        src: WirePath,
        dst: str | None = None,
        *,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        gitignore: bool | None = None,
        max_bytes: int | None = None,
        chunk: int | None = None,
        progress: Progress | None = None,
        deadline: float | None = None,
        progress_timeout: float | None = DEFAULT_DEADLINE,
    ) -> bytes | int:
        return self._run(
            self._aio._download_tree(
                src,
                dst,
                include=include,
                exclude=exclude,
                gitignore=gitignore,
                max_bytes=max_bytes,
                chunk=chunk,
                progress=progress,
                deadline=deadline,
                progress_timeout=progress_timeout,
            )
        )

    def changes(self, cursor: int | None = None, *, deadline: float | None = DEFAULT_DEADLINE) -> Changes:
        return self._run(self._aio.changes(cursor, deadline=deadline))
