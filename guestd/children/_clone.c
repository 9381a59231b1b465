/* guestd.children._clone: start a workload process with clone3(CLONE_VM | CLONE_VFORK),
 * directly inside its run's cgroup (CLONE_INTO_CGROUP), as the workload user, with no
 * Python code running in the child.
 *
 * Why native code: CPython's subprocess uses vfork only when no user, group or preexec_fn
 * is given; anything else forks the whole multi-threaded daemon and runs Python in the child
 * (3.46 ms vs 1.30 ms per exec here, and 47 vs 10 ms under TCG where the per-spawn move into
 * a cgroup costs 20-35 ms). clone3 places the child in its cgroup as it is created, so there
 * is no move at all, and CLONE_VFORK shares the parent's memory until exec, like vfork.
 *
 * Rules for child_main (it runs on its own stack but in the daemon's memory, while other
 * daemon threads go on): plain system calls only, no malloc, no locks, no Python. Credentials
 * change through raw syscalls, because glibc's wrappers would broadcast the change to every
 * thread of the daemon. Errors travel back through the shared plan (CLONE_VFORK makes the
 * parent wait until the child has exec'd or exited, so it reads them after the call).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define GD_CLONE_VM 0x00000100ULL
#define GD_CLONE_VFORK 0x00004000ULL
#define GD_CLONE_PIDFD 0x00001000ULL
#define GD_CLONE_INTO_CGROUP 0x200000000ULL
#define GD_CLONE_PARENT_SETTID 0x00100000ULL
#define GD_NR_CLOSE_RANGE 436
#define MAX_FDS 8
#define CHILD_STACK (64 * 1024)

/* Stages a failure is reported for; the Python side names them. */
enum { STAGE_NONE = 0, STAGE_SIGNALS, STAGE_SETSID, STAGE_FDS, STAGE_CTTY, STAGE_CREDS, STAGE_CWD, STAGE_EXEC, STAGE_STOPPED, STAGE_CGROUP };

/* Spawns in flight, for the watchdog. Once the child runs as the workload user, the workload
 * may SIGSTOP it before it execs, and CLONE_VFORK would then hold the spawning thread forever.
 * The kernel writes each child's pid into its slot (CLONE_PARENT_SETTID) before the child runs;
 * kill_stuck() SIGKILLs children that have not exec'd within a deadline. Slots are taken and
 * freed under slot_lock (spawns run in threads without the GIL); `returned` is set without it, as
 * soon as clone3 comes back. */
#define MAX_INFLIGHT 64
typedef struct {
    pid_t pid;
    int used;
    int returned;
    int killed;
    int64_t started_ns;
} slot_t;
static slot_t slots[MAX_INFLIGHT];
static pthread_mutex_t slot_lock = PTHREAD_MUTEX_INITIALIZER; /* claims, releases, the watchdog's scan */

struct gd_clone_args { /* the kernel's struct clone_args (v2, with cgroup) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};

typedef struct {
    char **paths; /* executables to try in order (a PATH search done by the parent) */
    Py_ssize_t npaths;
    char **argv;
    char **envp;
    const char *cwd; /* NULL: inherit */
    int fd_src[MAX_FDS], fd_dst[MAX_FDS], nfds;
    long uid, gid; /* -1: keep */
    int setsid, ctty;
    const char *oom; /* written to /proc/self/oom_score_adj, or NULL */
    Py_ssize_t oom_len;
    int set_nofile;
    struct rlimit nofile;
    int all_cpus; /* widen the CPU affinity to every CPU the cpuset allows (guestd may be pinned) */
    int nice_zero; /* back to nice 0 (guestd may run at a higher priority than its workload) */
    volatile int err, stage; /* out */
} plan_t;

#if defined(__x86_64__)
#define HAVE_CLONE3_TRAMPOLINE 1
/* long gd_clone3(struct gd_clone_args *args, size_t size, int (*fn)(void *), void *arg)
 * Parent: returns the pid or -errno. Child: runs fn(arg) on the stack in args and exits. */
long gd_clone3(struct gd_clone_args *args, size_t size, int (*fn)(void *), void *arg);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".type gd_clone3, @function\n"
    "gd_clone3:\n"
    "    mov %rdx, %r9\n" /* fn and arg survive the syscall in r9/r8 */
    "    mov %rcx, %r8\n"
    "    mov $435, %eax\n"
    "    syscall\n"
    "    test %rax, %rax\n"
    "    jz 1f\n"
    "    ret\n"
    "1:\n"
    "    xor %ebp, %ebp\n"
    "    and $-16, %rsp\n"
    "    mov %r8, %rdi\n"
    "    call *%r9\n"
    "    mov %eax, %edi\n"
    "    mov $231, %eax\n" /* exit_group */
    "    syscall\n"
    "    hlt\n"
    ".size gd_clone3, .-gd_clone3\n");
#else
#define HAVE_CLONE3_TRAMPOLINE 0
#endif

#if HAVE_CLONE3_TRAMPOLINE /* the child side exists only where the trampoline does */
static void close_from(int lowest, const int *keep, int nkeep) {
    /* Close every fd >= lowest except those in keep (small, unsorted). */
    int start = lowest;
    for (;;) {
        int next_keep = -1;
        for (int i = 0; i < nkeep; i++)
            if (keep[i] >= start && (next_keep < 0 || keep[i] < next_keep)) next_keep = keep[i];
        unsigned int last = next_keep < 0 ? ~0U : (unsigned int)next_keep - 1;
        if (next_keep != start) {
            if (syscall(GD_NR_CLOSE_RANGE, (unsigned int)start, last, 0) != 0) {
                /* Kernels before 5.9: every fd is O_CLOEXEC in guestd, so exec closes them. */
            }
        }
        if (next_keep < 0) return;
        start = next_keep + 1;
    }
}

static int child_main(void *arg) {
    plan_t *p = (plan_t *)arg;
    int saved = 0;

    /* Signal handlers of the daemon must never run here: back to defaults, then unblock. */
    p->stage = STAGE_SIGNALS;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction old;
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        if (sigaction(sig, NULL, &old) != 0) continue; /* glibc-internal signals */
        if (old.sa_handler != SIG_DFL) {
            struct sigaction dfl;
            memset(&dfl, 0, sizeof dfl);
            dfl.sa_handler = SIG_DFL;
            sigaction(sig, &dfl, NULL);
        }
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);

    p->stage = STAGE_SETSID;
    if (p->setsid && setsid() < 0) goto fail;

    /* Move each source out of the way first, so a source that is another's target is not lost. */
    p->stage = STAGE_FDS;
    int tmp[MAX_FDS];
    for (int i = 0; i < p->nfds; i++) {
        tmp[i] = fcntl(p->fd_src[i], F_DUPFD_CLOEXEC, 256);
        if (tmp[i] < 0) goto fail;
    }
    for (int i = 0; i < p->nfds; i++)
        if (dup2(tmp[i], p->fd_dst[i]) < 0) goto fail; /* dup2 clears O_CLOEXEC on the target */
    {
        int keep[MAX_FDS + 3] = {0, 1, 2};
        int nkeep = 3;
        for (int i = 0; i < p->nfds; i++) keep[nkeep++] = p->fd_dst[i];
        close_from(3, keep, nkeep);
    }

    p->stage = STAGE_CTTY;
    if (p->ctty && ioctl(0, TIOCSCTTY, 0) < 0) goto fail;

    if (p->oom != NULL) { /* guestd runs at -1000; what it starts must be killable (best effort) */
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (write(fd, p->oom, (size_t)p->oom_len) < 0) { /* keep going */
            }
            close(fd);
        }
    }
    if (p->set_nofile) setrlimit(RLIMIT_NOFILE, &p->nofile);
    if (p->nice_zero && setpriority(PRIO_PROCESS, 0, 0) != 0) { /* raising it needs no privilege */
    }
    if (p->all_cpus) {
        /* Every bit set: the kernel keeps those of CPUs that exist and the cpuset allows; exec
         * then places the process on the least busy of them (best effort). */
        unsigned char every_cpu[128];
        memset(every_cpu, 0xff, sizeof every_cpu);
        if (syscall(SYS_sched_setaffinity, 0, sizeof every_cpu, every_cpu) != 0) { /* keep going */
        }
    }

    p->stage = STAGE_CREDS;
    if (p->uid >= 0) {
        /* This memory is the daemon's until exec: never let the workload user ptrace it. The
         * flag is the shared mm's, so guestd itself is non-dumpable from the first spawn on
         * (setresuid would do the same); exec gives the workload program a fresh mm. */
        if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) goto fail;
        if (syscall(SYS_setgroups, 0, NULL) != 0) goto fail;
        if (syscall(SYS_setresgid, (gid_t)p->gid, (gid_t)p->gid, (gid_t)p->gid) != 0) goto fail;
        if (syscall(SYS_setresuid, (uid_t)p->uid, (uid_t)p->uid, (uid_t)p->uid) != 0) goto fail;
    }

    /* After the drop: the workload may only start in a directory it can enter itself. */
    p->stage = STAGE_CWD;
    if (p->cwd != NULL && chdir(p->cwd) != 0) goto fail;

    p->stage = STAGE_EXEC;
    for (Py_ssize_t i = 0; i < p->npaths; i++) {
        execve(p->paths[i], p->argv, p->envp);
        if (saved == 0 && errno != ENOENT && errno != ENOTDIR) saved = errno;
    }
    p->err = saved ? saved : errno;
    return 127;
fail:
    p->err = errno;
    return 127;
}
#endif

/* -- argument conversion ----------------------------------------------------------------- */

static char **bytes_array(PyObject *seq, PyObject **keep, Py_ssize_t *count) {
    /* A NULL-terminated char* array over a sequence of bytes; *keep holds the references. */
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of bytes");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyBytes_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "expected bytes");
            goto bad;
        }
        if ((Py_ssize_t)strlen(PyBytes_AS_STRING(item)) != PyBytes_GET_SIZE(item)) {
            PyErr_SetString(PyExc_ValueError, "embedded null byte");
            goto bad;
        }
        out[i] = PyBytes_AS_STRING(item);
    }
    *keep = fast;
    if (count) *count = n;
    return out;
bad:
    PyMem_Free(out);
    Py_DECREF(fast);
    return NULL;
}

PyDoc_STRVAR(spawn_doc,
             "spawn(paths, argv, envp, cwd, fds, uid, gid, setsid, ctty, cgroup_fd, oom, nofile) -> (pid, pidfd)\n\n"
             "Start a process with clone3(CLONE_VM|CLONE_VFORK|CLONE_PIDFD[|CLONE_INTO_CGROUP]).\n"
             "paths: executables to try; argv, envp: lists of bytes (envp None: inherit);\n"
             "cwd: bytes or None; fds: list of (source, target); uid/gid: -1 to keep;\n"
             "cgroup_fd: an O_PATH/O_DIRECTORY fd of a cgroup v2 directory, or -1;\n"
             "oom: bytes for /proc/self/oom_score_adj or None; nofile: (soft, hard) or None.\n"
             "Raises OSError with .stage (a str) when the child could not be started.");

static const char *stage_name(int stage) {
    switch (stage) {
    case STAGE_SIGNALS: return "signals";
    case STAGE_SETSID: return "setsid";
    case STAGE_FDS: return "fds";
    case STAGE_CTTY: return "ctty";
    case STAGE_CREDS: return "creds";
    case STAGE_CWD: return "cwd";
    case STAGE_EXEC: return "exec";
    case STAGE_STOPPED: return "stopped";
    case STAGE_CGROUP: return "cgroup";
    default: return "clone";
    }
}

static PyObject *stage_exception(int err, int stage, const char *filename) {
    /* The OSError (with .stage) for a child that could not be started, or NULL with an error set. */
    PyObject *name_o = filename ? PyUnicode_DecodeFSDefault(filename) : NULL; /* any bytes, as os does */
    if (filename != NULL && name_o == NULL) return NULL;
    PyObject *exc = name_o ? PyObject_CallFunction(PyExc_OSError, "isO", err, strerror(err), name_o)
                           : PyObject_CallFunction(PyExc_OSError, "is", err, strerror(err));
    Py_XDECREF(name_o);
    if (exc == NULL) return NULL;
    PyObject *name = PyUnicode_FromString(stage_name(stage));
    if (name == NULL || PyObject_SetAttrString(exc, "stage", name) != 0) {
        Py_XDECREF(name);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(name);
    return exc;
}

/* -- one spawn: prepared with the GIL, run without it, finished with it ------------------- */

typedef struct job {
    struct job *next;
    PyObject *token; /* submit(): handed back by collect() */
    plan_t plan;
    PyObject *keep_paths, *keep_argv, *keep_envp, *keep_cwd, *keep_oom, *keep_leaf;
    char *env_copy; /* envp None: guestd's environment copied (strings too), since the loop goes on */
    int cgroup_fd; /* the leaf to start in, or -1 */
    int parent_fd; /* make the leaf first: mkdirat(parent_fd, leaf_name), pids.max, O_PATH open */
    const char *leaf_name, *pids_max;
    Py_ssize_t pids_max_len;
    int leaf_fd, leaf_err; /* out: the leaf made (-1: none), or why it could not be */
    long ret; /* out: the pid, or -errno of clone3 */
    int pidfd, killed;
} job_t;

static void job_free(job_t *j) {
    PyMem_Free(j->plan.paths);
    PyMem_Free(j->plan.argv);
    if (j->keep_envp != NULL || j->env_copy != NULL) PyMem_Free(j->plan.envp);
    PyMem_Free(j->env_copy);
    Py_XDECREF(j->keep_paths);
    Py_XDECREF(j->keep_argv);
    Py_XDECREF(j->keep_envp);
    Py_XDECREF(j->keep_cwd);
    Py_XDECREF(j->keep_oom);
    Py_XDECREF(j->keep_leaf);
    Py_XDECREF(j->token);
    PyMem_Free(j);
}

static job_t *job_prepare(PyObject *args, PyObject *leaf_o) {
    /* Parses spawn()'s arguments into a job that owns everything the spawn reads. */
    PyObject *paths_o, *argv_o, *envp_o, *cwd_o, *fds_o, *oom_o, *nofile_o, *fds_fast = NULL;
    long uid, gid;
    int do_setsid, ctty, cgroup_fd, all_cpus = 0, nice_zero = 0;
    if (!PyArg_ParseTuple(args, "OOOOOllppiOO|pp", &paths_o, &argv_o, &envp_o, &cwd_o, &fds_o, &uid, &gid, &do_setsid,
                          &ctty, &cgroup_fd, &oom_o, &nofile_o, &all_cpus, &nice_zero))
        return NULL;
    job_t *j = PyMem_Calloc(1, sizeof *j);
    if (j == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    j->cgroup_fd = cgroup_fd;
    j->parent_fd = -1;
    j->leaf_fd = -1;
    j->pidfd = -1;
    plan_t *plan = &j->plan;
    plan->uid = uid;
    plan->gid = gid;
    plan->setsid = do_setsid;
    plan->ctty = ctty;
    plan->all_cpus = all_cpus;
    plan->nice_zero = nice_zero;
    if ((plan->paths = bytes_array(paths_o, &j->keep_paths, &plan->npaths)) == NULL) goto bad;
    if ((plan->argv = bytes_array(argv_o, &j->keep_argv, NULL)) == NULL) goto bad;
    if (envp_o == Py_None) {
        /* Pointers and strings both copied under the GIL: os.environ changes (setenv) may realloc
         * and free glibc's array and strings while the spawn thread reads them. */
        size_t n = 0, bytes = 0;
        while (environ[n] != NULL) bytes += strlen(environ[n++]) + 1;
        plan->envp = PyMem_Calloc(n + 1, sizeof(char *));
        j->env_copy = PyMem_Malloc(bytes ? bytes : 1);
        if (plan->envp == NULL || j->env_copy == NULL) {
            PyErr_NoMemory();
            goto bad;
        }
        char *at = j->env_copy;
        for (size_t i = 0; i < n; i++) {
            size_t len = strlen(environ[i]) + 1;
            memcpy(at, environ[i], len);
            plan->envp[i] = at;
            at += len;
        }
    } else if ((plan->envp = bytes_array(envp_o, &j->keep_envp, NULL)) == NULL) {
        goto bad;
    }
    if (cwd_o != Py_None) {
        if (!PyBytes_Check(cwd_o)) {
            PyErr_SetString(PyExc_TypeError, "cwd must be bytes or None");
            goto bad;
        }
        if ((Py_ssize_t)strlen(PyBytes_AS_STRING(cwd_o)) != PyBytes_GET_SIZE(cwd_o)) {
            PyErr_SetString(PyExc_ValueError, "embedded null byte");
            goto bad;
        }
        Py_INCREF(cwd_o);
        j->keep_cwd = cwd_o;
        plan->cwd = PyBytes_AS_STRING(cwd_o);
    }
    if ((fds_fast = PySequence_Fast(fds_o, "fds must be a sequence of (source, target)")) == NULL) goto bad;
    plan->nfds = (int)PySequence_Fast_GET_SIZE(fds_fast);
    if (plan->nfds > MAX_FDS) {
        PyErr_SetString(PyExc_ValueError, "too many fds");
        goto bad;
    }
    for (int i = 0; i < plan->nfds; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fds_fast, i), "ii", &plan->fd_src[i], &plan->fd_dst[i]))
            goto bad;
    }
    Py_CLEAR(fds_fast);
    if (oom_o != Py_None) {
        if (!PyBytes_Check(oom_o)) {
            PyErr_SetString(PyExc_TypeError, "oom must be bytes or None");
            goto bad;
        }
        Py_INCREF(oom_o);
        j->keep_oom = oom_o;
        plan->oom = PyBytes_AS_STRING(oom_o);
        plan->oom_len = PyBytes_GET_SIZE(oom_o);
    }
    if (nofile_o != Py_None) {
        unsigned long long soft, hard;
        if (!PyArg_ParseTuple(nofile_o, "KK", &soft, &hard)) goto bad;
        plan->set_nofile = 1;
        plan->nofile.rlim_cur = (rlim_t)soft;
        plan->nofile.rlim_max = (rlim_t)hard;
    }
    if (leaf_o != NULL && leaf_o != Py_None) {
        /* (parent_fd, name, pids_max or None): the run's leaf is made by the spawn thread */
        PyObject *name_o, *pids_o;
        if (!PyArg_ParseTuple(leaf_o, "iOO", &j->parent_fd, &name_o, &pids_o)) goto bad;
        if (!PyBytes_Check(name_o) || (pids_o != Py_None && !PyBytes_Check(pids_o))) {
            PyErr_SetString(PyExc_TypeError, "leaf: (fd, bytes, bytes or None)");
            goto bad;
        }
        Py_INCREF(leaf_o);
        j->keep_leaf = leaf_o;
        j->leaf_name = PyBytes_AS_STRING(name_o);
        if (pids_o != Py_None) {
            j->pids_max = PyBytes_AS_STRING(pids_o);
            j->pids_max_len = PyBytes_GET_SIZE(pids_o);
        }
        j->cgroup_fd = -1;
    }
    return j;
bad:
    Py_XDECREF(fds_fast);
    job_free(j);
    return NULL;
}

static int make_leaf(job_t *j) {
    /* mkdir the run's leaf, set its pids.max before any process is in it, open it O_PATH. */
    if (mkdirat(j->parent_fd, j->leaf_name, 0755) != 0) return errno;
    int err = 0;
    if (j->pids_max != NULL) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/pids.max", j->leaf_name);
        int fd = openat(j->parent_fd, path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, j->pids_max, (size_t)j->pids_max_len) < 0) err = errno;
        if (fd >= 0) close(fd);
    }
    if (err == 0) {
        j->leaf_fd = openat(j->parent_fd, j->leaf_name, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (j->leaf_fd < 0) err = errno;
    }
    if (err != 0) unlinkat(j->parent_fd, j->leaf_name, AT_REMOVEDIR);
    return err;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void job_run(job_t *j, void *stack) {
    /* The blocking part, without the GIL: the leaf, clone3 (back once the child has exec'd). */
#if !HAVE_CLONE3_TRAMPOLINE
    (void)stack;
    j->ret = -ENOSYS;
    return;
#else
    if (j->parent_fd >= 0) {
        j->leaf_err = make_leaf(j);
        if (j->leaf_err != 0) return;
        j->cgroup_fd = j->leaf_fd;
    }
    slot_t *slot = NULL;
    pthread_mutex_lock(&slot_lock);
    for (int i = 0; i < MAX_INFLIGHT && slot == NULL; i++) {
        if (!slots[i].used) {
            slot = &slots[i];
            slot->used = 1;
            slot->pid = 0;
            slot->returned = 0;
            slot->killed = 0;
            slot->started_ns = now_ns();
        }
    }
    pthread_mutex_unlock(&slot_lock);
    struct gd_clone_args ca;
    memset(&ca, 0, sizeof ca);
    ca.flags = GD_CLONE_VM | GD_CLONE_VFORK | GD_CLONE_PIDFD | (j->cgroup_fd >= 0 ? GD_CLONE_INTO_CGROUP : 0);
    if (slot != NULL) {
        ca.flags |= GD_CLONE_PARENT_SETTID;
        ca.parent_tid = (uint64_t)(uintptr_t)&slot->pid;
    }
    ca.pidfd = (uint64_t)(uintptr_t)&j->pidfd;
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)stack;
    ca.stack_size = CHILD_STACK;
    ca.cgroup = j->cgroup_fd >= 0 ? (uint64_t)j->cgroup_fd : 0;
    sigset_t all, old;
    sigfillset(&all);
    /* Blocked here, so no daemon signal handler runs in the child before it resets them. */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    j->ret = gd_clone3(&ca, sizeof ca, child_main, &j->plan);
    if (slot != NULL) __atomic_store_n(&slot->returned, 1, __ATOMIC_SEQ_CST);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (slot != NULL) {
        pthread_mutex_lock(&slot_lock);
        j->killed = slot->killed;
        slot->used = 0;
        pthread_mutex_unlock(&slot_lock);
    }
    if (j->ret > 0 && (j->killed || j->plan.err != 0)) {
        /* Stopped before exec and ended by the watchdog, or failed before exec: reap it here
         * (nobody else does, so its pid cannot be reused meanwhile). */
        int status;
        while (waitpid((pid_t)j->ret, &status, __WALL) < 0 && errno == EINTR) {
        }
        if (j->pidfd >= 0) close(j->pidfd);
        j->pidfd = -1;
    }
#endif
}

static PyObject *job_outcome(job_t *j, int with_leaf) {
    /* With the GIL: (pid, pidfd[, leaf_fd]) or NULL with the OSError set (.stage; .leaf_fd when
     * the spawn thread made a leaf: the caller removes it). */
    PyObject *exc = NULL;
    if (j->leaf_err != 0) {
        exc = stage_exception(j->leaf_err, STAGE_CGROUP, NULL);
    } else if (j->ret > 0 && j->killed) {
        exc = stage_exception(ETIMEDOUT, STAGE_STOPPED, NULL);
    } else if (j->ret < 0) {
        exc = stage_exception((int)-j->ret, STAGE_NONE, NULL);
    } else if (j->plan.err != 0) {
        const char *fname = NULL;
        if (j->plan.stage == STAGE_CWD) fname = j->plan.cwd;
        else if (j->plan.stage == STAGE_EXEC && j->plan.npaths > 0) fname = j->plan.argv[0];
        exc = stage_exception(j->plan.err, j->plan.stage, fname);
    } else if (with_leaf) {
        return Py_BuildValue("(lii)", j->ret, j->pidfd, j->leaf_fd);
    } else {
        return Py_BuildValue("(li)", j->ret, j->pidfd);
    }
    if (exc == NULL) return NULL;
    if (with_leaf) {
        PyObject *fd = PyLong_FromLong(j->leaf_fd);
        if (fd == NULL || PyObject_SetAttrString(exc, "leaf_fd", fd) != 0) {
            Py_XDECREF(fd);
            Py_DECREF(exc);
            return NULL;
        }
        Py_DECREF(fd);
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *gd_spawn(PyObject *self, PyObject *args) {
    (void)self;
#if !HAVE_CLONE3_TRAMPOLINE
    (void)args;
    PyErr_SetString(PyExc_NotImplementedError, "clone3 spawn is not built for this architecture");
    return NULL;
#else
    job_t *j = job_prepare(args, NULL);
    if (j == NULL) return NULL;
    void *stack = mmap(NULL, CHILD_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        job_free(j);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    job_run(j, stack);
    Py_END_ALLOW_THREADS
    munmap(stack, CHILD_STACK);
    PyObject *result = job_outcome(j, 0);
    job_free(j);
    return result;
#endif
}

/* -- spawn threads: submit() queues a job, a thread runs it without the GIL, collect() ------
 * The event loop hands a spawn to a thread of its own and learns it is done through an eventfd
 * it watches: no Python thread, so neither side waits for the GIL to pass the spawn along (the
 * thread-pool hop with its two GIL hand-offs cost ~70 us each way per exec here). */

#define SPAWN_THREADS 4 /* a spawn that hangs (an exec from a stuck file system) holds one */
static pthread_mutex_t q_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t q_cond = PTHREAD_COND_INITIALIZER;
static job_t *q_head, *q_tail, *done_head;
static int done_fd = -1;

static void *spawn_thread(void *arg) {
    (void)arg;
    void *stack = mmap(NULL, CHILD_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    for (;;) {
        pthread_mutex_lock(&q_lock);
        while (q_head == NULL) pthread_cond_wait(&q_cond, &q_lock);
        job_t *j = q_head;
        q_head = j->next;
        if (q_head == NULL) q_tail = NULL;
        pthread_mutex_unlock(&q_lock);
        if (stack == MAP_FAILED) {
            j->ret = -ENOMEM;
        } else {
            job_run(j, stack);
        }
        pthread_mutex_lock(&q_lock);
        j->next = done_head;
        done_head = j;
        pthread_mutex_unlock(&q_lock);
        uint64_t one = 1;
        while (write(done_fd, &one, sizeof one) < 0 && errno == EINTR) {
        }
    }
    return NULL;
}

PyDoc_STRVAR(spawner_doc, "spawner() -> fd\n\n"
                          "Start the spawn threads (once) and return the eventfd that becomes readable\n"
                          "when submitted spawns are done (collect() them).");

static PyObject *gd_spawner(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#if !HAVE_CLONE3_TRAMPOLINE
    PyErr_SetString(PyExc_NotImplementedError, "clone3 spawn is not built for this architecture");
    return NULL;
#else
    if (done_fd >= 0) return PyLong_FromLong(done_fd);
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    done_fd = fd;
    /* Every signal blocked in the threads: handlers run in the main thread, and a child starts
     * with everything blocked until it has reset them. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int started = 0, err = 0;
    for (int i = 0; i < SPAWN_THREADS; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        err = pthread_create(&t, &attr, spawn_thread, NULL);
        pthread_attr_destroy(&attr);
        if (err == 0) started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (started == 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(done_fd);
#endif
}

PyDoc_STRVAR(submit_doc, "submit(token, leaf, *spawn_args) -> None\n\n"
                         "Queue spawn(*spawn_args) for a spawn thread; collect() hands back token with\n"
                         "the outcome. leaf: None, or (parent_fd, name, pids_max or None) to make the\n"
                         "run's leaf cgroup there first (cgroup_fd is then ignored).");

static PyObject *gd_submit(PyObject *self, PyObject *args) {
    (void)self;
    if (done_fd < 0) {
        PyErr_SetString(PyExc_RuntimeError, "spawner() was not started");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 2) {
        PyErr_SetString(PyExc_TypeError, "submit(token, leaf, *spawn_args)");
        return NULL;
    }
    PyObject *rest = PyTuple_GetSlice(args, 2, n);
    if (rest == NULL) return NULL;
    job_t *j = job_prepare(rest, PyTuple_GET_ITEM(args, 1));
    Py_DECREF(rest);
    if (j == NULL) return NULL;
    j->token = PyTuple_GET_ITEM(args, 0);
    Py_INCREF(j->token);
    pthread_mutex_lock(&q_lock);
    if (q_tail != NULL) q_tail->next = j;
    else q_head = j;
    q_tail = j;
    pthread_cond_signal(&q_cond);
    pthread_mutex_unlock(&q_lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(collect_doc, "collect() -> list of (token, (pid, pidfd, leaf_fd) or OSError)\n\n"
                          "The submitted spawns that are done (in no particular order).");

static PyObject *gd_collect(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    uint64_t count;
    if (done_fd >= 0 && read(done_fd, &count, sizeof count) < 0 && errno != EAGAIN) { /* reset it */
    }
    pthread_mutex_lock(&q_lock);
    job_t *j = done_head;
    done_head = NULL;
    pthread_mutex_unlock(&q_lock);
    PyObject *out = PyList_New(0);
    while (j != NULL) {
        job_t *next = j->next;
        if (out != NULL) {
            PyObject *outcome = job_outcome(j, 1);
            if (outcome == NULL) {
                PyObject *type, *value, *tb;
                PyErr_Fetch(&type, &value, &tb);
                PyErr_NormalizeException(&type, &value, &tb);
                Py_XDECREF(type);
                Py_XDECREF(tb);
                outcome = value;
            }
            PyObject *pair = outcome != NULL ? PyTuple_Pack(2, j->token, outcome) : NULL;
            Py_XDECREF(outcome);
            if (pair == NULL || PyList_Append(out, pair) != 0) Py_CLEAR(out);
            Py_XDECREF(pair);
        }
        job_free(j);
        j = next;
    }
    return out;
}

PyDoc_STRVAR(kill_stuck_doc, "kill_stuck(stopped_after_s, older_than_s) -> int\n\n"
                             "SIGKILL spawned children that have not exec'd: those found stopped after\n"
                             "stopped_after_s, and any after older_than_s. Returns how many.");

static int is_stopped(pid_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *paren = strrchr(buf, ')'); /* the state follows the command name, which may hold spaces */
    return paren != NULL && paren[1] == ' ' && (paren[2] == 'T' || paren[2] == 't');
}

static PyObject *gd_kill_stuck(PyObject *self, PyObject *args) {
    double stopped_after, older_than;
    (void)self;
    if (!PyArg_ParseTuple(args, "dd", &stopped_after, &older_than)) return NULL;
    int64_t now = now_ns();
    int n = 0;
    pthread_mutex_lock(&slot_lock); /* a slot is neither claimed nor released while it is looked at */
    for (int i = 0; i < MAX_INFLIGHT; i++) {
        slot_t *s = &slots[i];
        pid_t pid = __atomic_load_n(&s->pid, __ATOMIC_SEQ_CST);
        if (!s->used || pid <= 0 || __atomic_load_n(&s->returned, __ATOMIC_SEQ_CST)) continue;
        double age = (double)(now - s->started_ns) / 1e9;
        if (age < older_than && !(age >= stopped_after && is_stopped(pid))) continue;
        /* Marked first: once it is killed the spawning thread wakes and must see why. */
        s->killed = 1;
        kill(pid, SIGKILL); /* nobody but the spawning thread reaps it: the pid cannot be reused */
        n++;
    }
    pthread_mutex_unlock(&slot_lock);
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(subreaper_doc, "become_subreaper()\n--\n\n"
                            "prctl(PR_SET_CHILD_SUBREAPER, 1): orphans of what guestd starts are re-parented to it\n"
                            "(guestd/libc.py: here rather than through ctypes, ~1 ms of every start); OSError on failure.");

static PyObject *gd_become_subreaper(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

#ifdef __GLIBC__ /* musl has no mallopt: guestd/libc.py then falls back to ctypes, which says so */
PyDoc_STRVAR(mallopt_doc, "mallopt(param, value)\n--\n\n"
                         "glibc's mallopt (guestd/libc.py, for guestd/memtune.py): True when it took the setting.");

static PyObject *gd_mallopt(PyObject *self, PyObject *args) {
    int param, value;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii", &param, &value)) return NULL;
    return PyBool_FromLong(mallopt(param, value));
}
#endif

static PyMethodDef methods[] = {
    {"become_subreaper", gd_become_subreaper, METH_NOARGS, subreaper_doc},
#ifdef __GLIBC__
    {"mallopt", gd_mallopt, METH_VARARGS, mallopt_doc},
#endif
    {"spawn", gd_spawn, METH_VARARGS, spawn_doc},
    {"spawner", gd_spawner, METH_NOARGS, spawner_doc},
    {"submit", gd_submit, METH_VARARGS, submit_doc},
    {"collect", gd_collect, METH_NOARGS, collect_doc},
    {"kill_stuck", gd_kill_stuck, METH_VARARGS, kill_stuck_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "guestd.children._clone", "clone3 spawn into a cgroup (see the C file's head)", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__clone(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "AVAILABLE", HAVE_CLONE3_TRAMPOLINE) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
