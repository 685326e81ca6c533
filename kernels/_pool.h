/* A pool of threads kept between calls, for the CPU kernels (kernels/_decode.c, _qmatmul.c).
 *
 * A decode step makes ~150 kernel calls of 0.05-0.5 ms each: starting threads per call would
 * cost as much as the work. `pool_run(fn, args, n)` runs fn(args[0]) on the calling thread
 * and fn(args[i]) on the others, and returns when all are done. One call at a time uses the
 * pool: a concurrent caller runs its tasks on its own thread.
 *
 * Which threads: torch's own OpenMP team where the module is built with OpenMP and shares
 * torch's runtime (`pool_openmp`, set from Python once kernels/threads.py has checked
 * that torch's thread count is the one this runtime sees). torch's workers spin for a while
 * after each op, and so did a pool of ours, each on every core: a step on two cores was
 * slower with both pools on both than with either alone, so the cores were split between
 * the matmuls and the attention (engine/core_split.py). On one team both get every core
 * (2-core AMD EPYC, in-process: 8 x 7K tokens sparse 44.7 -> 35.3 ms a step, 1 x 1K dense
 * 8.5 -> 7.8; docs/perf-notes.md, 2026-11-27 sixth).
 * Otherwise, threads of our own: worker i started on first need and kept for the process's
 * life, waiting for a new generation of tasks, spinning briefly (the next call of a step
 * comes within microseconds), then sleeping. Fork-safe: a forked child starts a new pool of
 * its own threads (call pool_init from the module's init). */
#ifndef STRATA_KERNELS_POOL_H
#define STRATA_KERNELS_POOL_H

#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define POOL_MAX 64
#define POOL_SPIN 4000

typedef void (*pool_fn)(void *);

static struct {
    pthread_mutex_t busy, mu;
    pthread_cond_t wake, done;
    int size;
    pthread_t tid[POOL_MAX];
    pool_fn fn;
    void *args[POOL_MAX];
    /* atomics (__atomic builtins): the generation and its task count in one word (a worker
     * reads both at once: worker i takes part in a generation when i < its count, and the
     * caller waits for exactly those), and how many of them are still running */
    uint64_t word, start[POOL_MAX];
    int remaining;
    int openmp;         /* 1: the calls run on the OpenMP team (pool_openmp) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0};

static inline void pool_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

/* arg: the worker's index; it starts from the generation current when it was created (read
 * by its creator, which holds the pool: a read here could already see the next one) */
static void *pool_worker(void *arg) {
    const uint64_t idx = (uint64_t)(intptr_t)arg;
    uint64_t seen = pool.start[idx];
    for (;;) {
        uint64_t w = seen;
        for (int i = 0;
             i < POOL_SPIN && (w = __atomic_load_n(&pool.word, __ATOMIC_ACQUIRE)) == seen; i++)
            pool_relax();
        if (w == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((w = __atomic_load_n(&pool.word, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = w;
        if (idx >= (w & 0xff))
            continue;
        pool.fn(pool.args[idx]);
        if (__atomic_sub_fetch(&pool.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* a forked child has the parent's pool state but none of its threads */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.size = 0;
    pool.openmp = 0;        /* the parent's OpenMP team is not the child's either */
}

static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Python's pool_openmp(flag): run the calls on the OpenMP team (1) or our own threads (0;
 * -1: as they are); returns (1 if they run on the team now, else 0; the OpenMP runtime's
 * thread count, omp_get_max_threads, which kernels/threads.py compares with torch's, or -1
 * where the module is built without OpenMP: then the flag is ignored) */
static PyObject *pool_openmp(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "i", &flag))
        return NULL;
#ifdef _OPENMP
    if (flag >= 0)
        pool.openmp = flag != 0;
    return Py_BuildValue("ii", pool.openmp, omp_get_max_threads());
#else
    (void)flag;
    return Py_BuildValue("ii", 0, -1);
#endif
}

/* pool_openmp's entry in a module's method table */
#define POOL_OPENMP_METHOD                                                                   \
    {"pool_openmp", pool_openmp, METH_VARARGS,                                             \
     "pool_openmp(flag): the pool's calls on the OpenMP team (1), on threads of its own (0) " \
     "or as they are (-1) (kernels/_pool.h); returns (on the team, omp_get_max_threads() or " \
     "-1 without OpenMP)"}

/* fn(args[i]) for i < n, args[0] on this thread; returns when all are done */
static void pool_run(pool_fn fn, void **args, int n) {
    if (n > POOL_MAX)
        n = POOL_MAX;
    if (n < 2 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int i = 0; i < n; i++)
            fn(args[i]);
        return;
    }
#ifdef _OPENMP
    if (pool.openmp) {
#pragma omp parallel for num_threads(n) schedule(static, 1)
        for (int i = 0; i < n; i++)
            fn(args[i]);
        pthread_mutex_unlock(&pool.busy);
        return;
    }
#endif
    while (pool.size < n - 1 &&
           (pool.start[pool.size + 1] = __atomic_load_n(&pool.word, __ATOMIC_ACQUIRE), 1) &&
           pthread_create(&pool.tid[pool.size + 1], NULL, pool_worker,
                          (void *)(intptr_t)(pool.size + 1)) == 0)
        pool.size++;
    const int workers = n - 1 < pool.size ? n - 1 : pool.size;   /* threads that started */
    pool.fn = fn;
    for (int i = 0; i <= workers; i++)
        pool.args[i] = args[i];
    __atomic_store_n(&pool.remaining, workers, __ATOMIC_RELEASE);
    const uint64_t gen = (__atomic_load_n(&pool.word, __ATOMIC_ACQUIRE) >> 8) + 1;
    pthread_mutex_lock(&pool.mu);
    __atomic_store_n(&pool.word, gen << 8 | (uint64_t)(workers + 1), __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(args[0]);
    for (int i = workers + 1; i < n; i++)          /* tasks no thread could be started for */
        fn(args[i]);
    for (int i = 0; i < POOL_SPIN && __atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE); i++)
        pool_relax();
    pthread_mutex_lock(&pool.mu);
    while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE))
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

#endif
