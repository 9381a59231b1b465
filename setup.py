"""The one native piece: guestd.children._clone (clone3 into a cgroup; see its C file).

optional=True: where it cannot be built (no compiler, another architecture) guestd falls
back to subprocess.Popen and says so in system.info.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("guestd.children._clone", ["guestd/children/_clone.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
