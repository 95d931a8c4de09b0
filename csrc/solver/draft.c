/* The four inner loops of dhp's draft builder, compiled: the choice of a wide sample's window
 * (megatron_dhp/solver/dhp/layout.py, `choose_window`), the LPT fill of the bins with local moves
 * (megatron_dhp/solver/dhp/fill.py, `BinSet`, `fill_in_order`, `improve`) and the fill of the wide groups'
 * waits with one-rank samples (layout.py, `fill_holes`), and list schedules of wide samples on the ranks free first
 * (scatter.py, `list_ends`).
 *
 * Each is the Python of those files, operation for operation in IEEE double (built without FMA contraction),
 * so a plan is the same to the last bit with or without this module. The rules both keep, their tie-breaks
 * and the order of their sums, are stated once, in the docstring of megatron_dhp/solver/dhp/native.py; the
 * code below names them by their tags ([W1] ... [H2]) where it keeps them, and does not restate them.
 * tests/solver/test_draft_native.py runs each loop and the whole planner both ways on random inputs and
 * compares the results bit for bit. The Python stays the reference and the fallback where no C compiler
 * built this file. Arrays come in through the buffer protocol (C-contiguous float64 / int64), so no numpy
 * headers are needed to build it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- buffers ------------------------------------------------------------------------------------- */

typedef struct {
  Py_buffer view;
  Py_ssize_t len;
  int held;
} Array;

static int array_of(PyObject *obj, Array *a, char kind, const char *name) {
  a->held = 0;
  if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
  a->held = 1;
  const char *f = a->view.format ? a->view.format : "B";
  if (*f == '@' || *f == '=' || *f == '<') f++;
  int ok = a->view.itemsize == 8 && (kind == 'd' ? (*f == 'd') : (*f == 'l' || *f == 'q')) && f[1] == '\0';
  if (!ok) {
    PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous %s array, got format '%s' of %zd-byte items", name,
                 kind == 'd' ? "float64" : "int64", a->view.format ? a->view.format : "?", a->view.itemsize);
    return -1;
  }
  a->len = a->view.len / 8;
  return 0;
}

static void release(Array *arrays, int count) {
  for (int k = 0; k < count; k++)
    if (arrays[k].held) PyBuffer_Release(&arrays[k].view);
}

#define F64(a) ((const double *)(a).view.buf)
#define I64(a) ((const int64_t *)(a).view.buf)

/* ---- place_wide's window choice ------------------------------------------------------------------ */

/* choose_window(ready, start, size, firsts, time, overhead, by, speeds, capacity) -> (j, begin)
 *
 * Windows are flat, in segments of one size each starting at `firsts`; `by` is None or a float, `speeds`
 * and `capacity` both None or both arrays. Each segment's pick is [W1]'s, the segments' [W2]'s, in [W3]'s
 * arithmetic. `speeds` weigh the cost here even without `by`, where the Python ignores them: its caller
 * (`layout.native_choose_window`) passes them only with `by`. */
static PyObject *choose_window(PyObject *self, PyObject *args) {
  PyObject *o[9];
  if (!PyArg_ParseTuple(args, "OOOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8]))
    return NULL;
  Array a[7], capacity;
  memset(a, 0, sizeof a);
  memset(&capacity, 0, sizeof capacity);
  (void)self;
  int weighted = o[7] != Py_None;
  if (array_of(o[0], &a[0], 'd', "ready") < 0 || array_of(o[1], &a[1], 'q', "start") < 0 ||
      array_of(o[2], &a[2], 'q', "size") < 0 || array_of(o[3], &a[3], 'q', "firsts") < 0 ||
      array_of(o[4], &a[4], 'd', "time") < 0 || array_of(o[5], &a[5], 'd', "overhead") < 0 ||
      (weighted && (array_of(o[7], &a[6], 'd', "speeds") < 0))) {
    release(a, 7);
    return NULL;
  }
  if (weighted && array_of(o[8], &capacity, 'd', "capacity") < 0) {
    release(a, 7);
    release(&capacity, 1);
    return NULL;
  }
  int has_by = o[6] != Py_None;
  double by = has_by ? PyFloat_AsDouble(o[6]) : 0.0;
  const double *ready = F64(a[0]), *time = F64(a[4]), *over = F64(a[5]);
  const int64_t *start = I64(a[1]), *size = I64(a[2]), *firsts = I64(a[3]);
  Py_ssize_t n = a[0].len, w = a[1].len, segments = a[3].len;
  PyObject *result = NULL;
  double *buf = malloc(sizeof(double) * (size_t)(2 * (n + 1) + 3 * w + 1));
  if (buf == NULL || (has_by && by == -1.0 && PyErr_Occurred())) {
    if (buf == NULL) PyErr_NoMemory();
    goto done;
  }
  if (a[2].len != w || a[4].len != w || a[5].len != w || segments < 1 || (weighted && (a[6].len != n || capacity.len != w))) {
    PyErr_SetString(PyExc_ValueError, "choose_window: arrays of mismatched lengths");
    goto done;
  }
  double *prefix = buf, *weight = buf + n + 1, *begin = buf + 2 * (n + 1), *finish = begin + w, *cost = finish + w;
  prefix[0] = 0.0;
  weight[0] = 0.0;
  for (Py_ssize_t r = 0; r < n; r++) {  /* [W3]: numpy's cumsum, sequential */
    prefix[r + 1] = r ? prefix[r] + ready[r] : ready[r];
    if (weighted) weight[r + 1] = r ? weight[r] + F64(a[6])[r] * ready[r] : F64(a[6])[r] * ready[r];
  }
  for (Py_ssize_t k = 0; k < w; k++) {
    int64_t s = start[k], e = start[k] + size[k];
    if (s < 0 || size[k] < 1 || e > n) {
      PyErr_SetString(PyExc_ValueError, "choose_window: a window outside the ranks");
      goto done;
    }
    double b = ready[s];
    for (int64_t r = s + 1; r < e; r++) b = ready[r] > b ? ready[r] : b;
    begin[k] = b;
    finish[k] = b + time[k] + over[k];
    cost[k] = weighted ? finish[k] * F64(capacity)[k] - (weight[e] - weight[s]) : (double)size[k] * b - (prefix[e] - prefix[s]);
  }
  Py_ssize_t j = -1;
  for (Py_ssize_t g = 0; g < segments; g++) {  /* [W1] per segment, [W2] over them */
    Py_ssize_t lo = (Py_ssize_t)firsts[g], hi = g + 1 < segments ? (Py_ssize_t)firsts[g + 1] : w;
    int all_late = 1;
    if (has_by)
      for (Py_ssize_t k = lo; k < hi; k++) all_late &= finish[k] > by;
    Py_ssize_t best = -1;
    double best_order = 0.0;
    for (Py_ssize_t k = lo; k < hi; k++) {
      double order = !has_by || all_late ? finish[k] : (finish[k] > by ? 1.0 : 0.0);
      if (best < 0 || order < best_order ||
          (order == best_order && (cost[k] < cost[best] || (cost[k] == cost[best] && start[k] < start[best])))) {
        best = k;
        best_order = order;
      }
    }
    if (best < 0) continue;
    if (j < 0 || finish[best] < finish[j] * (1 - 1e-3)) j = best;
  }
  if (j < 0) {
    PyErr_SetString(PyExc_ValueError, "choose_window: no window");
    goto done;
  }
  result = Py_BuildValue("nd", j, begin[j]);
done:
  free(buf);
  release(a, 7);
  release(&capacity, 1);
  return result;
}

/* ---- the LPT fill ------------------------------------------------------------------------------- */

typedef struct {
  /* inputs */
  Py_ssize_t n, num_bins, num_classes;
  const int64_t *min_degree, *shared, *held, *class_size, *bin_class, *bin_size, *bin_cap;
  const double *times, *class_overhead, *bin_overhead;
  int scan;
  /* bins */
  double *finish;
  int64_t *room;  /* the largest room of a bin's microbatches (0 without one) */
  int *first_mb, *last_mb;
  /* classes: each a run of `sorted` (by finish, then bin) from class_start */
  int *class_start, *class_count, *sorted;
  /* microbatches: a pool, linked in order per bin; items linked in order per microbatch */
  int64_t *mb_room;
  int *mb_next, *mb_prev, *mb_head, *mb_tail, *mb_count, *free_mb;
  int free_top;
  /* items */
  int *item_next, *item_prev, *item_mb, *item_bin;
} Fill;

static inline int64_t load(const Fill *f, int item, int64_t size) { return f->shared[item] + size * f->held[item]; }
static inline double time_of(const Fill *f, int c, int item) { return f->times[(Py_ssize_t)c * f->n + item]; }
static inline int before(const Fill *f, int b, int other) {  /* [B1] */
  return f->finish[b] < f->finish[other] || (f->finish[b] == f->finish[other] && b < other);
}

static void refresh(Fill *f, int b) {  /* `BinSet._refresh`: the bin's room and its place in its class [B1] */
  int64_t room = 0;
  int any = 0;
  for (int k = f->first_mb[b]; k >= 0; k = f->mb_next[k]) {
    room = !any || f->mb_room[k] > room ? f->mb_room[k] : room;
    any = 1;
  }
  f->room[b] = room;
  int c = (int)f->bin_class[b], *list = f->sorted + f->class_start[c], count = f->class_count[c], at = 0;
  while (list[at] != b) at++;
  memmove(list + at, list + at + 1, sizeof(int) * (size_t)(count - at - 1));
  int pos = 0;
  while (pos < count - 1 && before(f, list[pos], b)) pos++;
  memmove(list + pos + 1, list + pos, sizeof(int) * (size_t)(count - 1 - pos));
  list[pos] = b;
}

/* `BinSet.best_bin` [B2]: the bin where the item finishes earliest, and that finish; -1 where none holds it. */
static int best_bin(const Fill *f, int item, int exclude, double *out) {
  double best = INFINITY;
  int best_b = -1;
  for (int c = 0; c < f->num_classes; c++) {
    int64_t size = f->class_size[c];
    if (size < f->min_degree[item]) continue;
    int64_t length = load(f, item, size);
    double m = f->class_overhead[c], t = time_of(f, c, item), first = 0.0, cand = 0.0;
    int have_first = 0, cand_b = -1;
    const int *list = f->sorted + f->class_start[c];
    int count = f->class_count[c] < f->scan ? f->class_count[c] : f->scan;
    for (int k = 0; k < count; k++) {
      int b = list[k];
      double fin = f->finish[b];
      if (b == exclude) continue;
      if (!have_first) {
        have_first = 1;
        first = fin;
        cand = fin + t + (f->room[b] >= length ? 0.0 : m);
        cand_b = b;
        if (f->room[b] >= length) break;
      } else if (fin >= first + m) {
        break;
      } else if (f->room[b] >= length) {
        double v = fin + t;
        if (v < cand || (v == cand && b < cand_b)) {
          cand = v;
          cand_b = b;
        }
        break;
      }
    }
    if (have_first && (cand < best || (cand == best && cand_b < best_b))) {
      best = cand;
      best_b = cand_b;
    }
  }
  *out = best;
  return best_b;
}

/* Doubly linked lists over index arrays: a bin's microbatches, a microbatch's items, each in order. */
static void link_append(int *next, int *prev, int *head, int *tail, int node) {
  next[node] = -1;
  prev[node] = *tail;
  if (*tail >= 0)
    next[*tail] = node;
  else
    *head = node;
  *tail = node;
}

static void link_remove(int *next, int *prev, int *head, int *tail, int node) {
  if (prev[node] >= 0)
    next[prev[node]] = next[node];
  else
    *head = next[node];
  if (next[node] >= 0)
    prev[next[node]] = prev[node];
  else
    *tail = prev[node];
}

static int new_mb(Fill *f, int b, int64_t room) {
  int k = f->free_mb[--f->free_top];
  f->mb_room[k] = room;
  f->mb_head[k] = f->mb_tail[k] = -1;
  f->mb_count[k] = 0;
  link_append(f->mb_next, f->mb_prev, &f->first_mb[b], &f->last_mb[b], k);
  return k;
}

static void append_item(Fill *f, int k, int item) {
  f->item_mb[item] = k;
  link_append(f->item_next, f->item_prev, &f->mb_head[k], &f->mb_tail[k], item);
  f->mb_count[k]++;
}

/* `BinSet.add` (`layout.add_to_group`): [B3], [B4]. */
static void add(Fill *f, int item, int b) {
  int c = (int)f->bin_class[b];
  int64_t tokens = load(f, item, f->bin_size[b]), best_room = INT64_MAX;
  int target = -1;
  for (int k = f->first_mb[b]; k >= 0; k = f->mb_next[k])
    if (tokens <= f->mb_room[k] && f->mb_room[k] < best_room) {
      target = k;
      best_room = f->mb_room[k];
    }
  double t = time_of(f, c, item);
  if (target >= 0) {
    f->mb_room[target] -= tokens;
  } else {
    target = new_mb(f, b, f->bin_size[b] * f->bin_cap[b] - tokens);
    t += f->bin_overhead[b];
  }
  append_item(f, target, item);
  f->finish[b] += t;
  f->item_bin[item] = b;
  refresh(f, b);
}

/* `BinSet.remove`: [B3], [B4]. */
static void remove_item(Fill *f, int item) {
  int b = f->item_bin[item], k = f->item_mb[item];
  link_remove(f->item_next, f->item_prev, &f->mb_head[k], &f->mb_tail[k], item);
  f->mb_count[k]--;
  f->mb_room[k] += load(f, item, f->bin_size[b]);
  f->finish[b] -= time_of(f, (int)f->bin_class[b], item);
  if (f->mb_count[k] == 0) {
    link_remove(f->mb_next, f->mb_prev, &f->first_mb[b], &f->last_mb[b], k);
    f->free_mb[f->free_top++] = k;
    f->finish[b] -= f->bin_overhead[b];
  }
  f->item_bin[item] = -1;
  refresh(f, b);
}

static int makespan(const Fill *f, double *out) {  /* [B1], over the classes' last bins */
  int worst = -1;
  for (int c = 0; c < f->num_classes; c++) {
    if (!f->class_count[c]) continue;
    int b = f->sorted[f->class_start[c] + f->class_count[c] - 1];
    if (worst < 0 || before(f, worst, b)) worst = b;
  }
  *out = worst >= 0 ? f->finish[worst] : 0.0;
  return worst;
}

/* `improve` [B6]: one sample at a time off the latest bin to where the pair's later finish is earliest. */
static void improve(Fill *f, const int *ascending, Py_ssize_t count, double floor_s, long max_moves) {
  for (long move = 0; move < max_moves; move++) {
    double span;
    int worst = makespan(f, &span);
    if (worst < 0 || span <= floor_s) return;
    int found = 0, best_item = -1, best_target = -1;
    double best_after = 0.0;
    for (Py_ssize_t k = 0; k < count; k++) {
      int item = ascending[k];
      if (f->item_bin[item] != worst) continue;
      double cost;
      int target = best_bin(f, item, worst, &cost);
      int alone = f->mb_count[f->item_mb[item]] == 1;
      double saving = time_of(f, (int)f->bin_class[worst], item) + (alone ? f->bin_overhead[worst] : 0.0);
      double out = span - saving, after = out >= cost ? out : cost;
      if (target >= 0 && after < span - 1e-12 && (!found || after < best_after)) {
        found = 1;
        best_after = after;
        best_item = item;
        best_target = target;
      }
    }
    if (!found) return;
    remove_item(f, best_item);
    add(f, best_item, best_target);
  }
}

static int cmp_int(const void *x, const void *y) { return (*(const int *)x > *(const int *)y) - (*(const int *)x < *(const int *)y); }

#define FILL_ARRAYS 12

/* The arguments both fills share: (order, min_degree, shared, held, times, class_size, class_overhead,
 * bin_class, bin_size, bin_cap, bin_start, bin_overhead). `order`: the items in the order they are placed;
 * `times`: classes x items seconds, row-major; the bins start empty at `bin_start`, each of a class (sorted
 * by size). Sets up `f` (its memory in `*memory`, for the caller to free); -1 with an exception set. */
static int fill_setup(Fill *f, Array *a, PyObject **o, void **memory) {
  static const char *names[FILL_ARRAYS] = {"order", "min_degree", "shared", "held", "times", "class_size",
                                           "class_overhead", "bin_class", "bin_size", "bin_cap", "bin_start",
                                           "bin_overhead"};
  const char *kind_of = "qqqqdqdqqqdd";
  for (int k = 0; k < FILL_ARRAYS; k++)
    if (array_of(o[k], &a[k], kind_of[k], names[k]) < 0) return -1;
  memset(f, 0, sizeof *f);
  Py_ssize_t count = a[0].len, n = a[1].len, nb = a[7].len, nc = a[5].len;
  if (a[2].len != n || a[3].len != n || a[4].len != nc * n || a[6].len != nc || a[8].len != nb || a[9].len != nb ||
      a[10].len != nb || a[11].len != nb) {
    PyErr_SetString(PyExc_ValueError, "fill: arrays of mismatched lengths");
    return -1;
  }
  f->n = n;
  f->num_bins = nb;
  f->num_classes = nc;
  f->min_degree = I64(a[1]);
  f->shared = I64(a[2]);
  f->held = I64(a[3]);
  f->times = F64(a[4]);
  f->class_size = I64(a[5]);
  f->class_overhead = F64(a[6]);
  f->bin_class = I64(a[7]);
  f->bin_size = I64(a[8]);
  f->bin_cap = I64(a[9]);
  f->bin_overhead = F64(a[11]);
  Py_ssize_t mbs = count + 1;
  size_t bytes = sizeof(double) * nb + sizeof(int64_t) * (nb + mbs) + sizeof(int) * (3 * nb + 3 * nc + 6 * mbs + 4 * n + 1);
  char *p = *memory = calloc(1, bytes);
  if (p == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  f->finish = (double *)p; p += sizeof(double) * nb;
  f->room = (int64_t *)p; p += sizeof(int64_t) * nb;
  f->mb_room = (int64_t *)p; p += sizeof(int64_t) * mbs;
  int *ip = (int *)p;
  f->first_mb = ip; ip += nb;
  f->last_mb = ip; ip += nb;
  f->sorted = ip; ip += nb;
  f->class_start = ip; ip += nc;
  f->class_count = ip; ip += nc;
  f->mb_next = ip; ip += mbs;
  f->mb_prev = ip; ip += mbs;
  f->mb_head = ip; ip += mbs;
  f->mb_tail = ip; ip += mbs;
  f->mb_count = ip; ip += mbs;
  f->free_mb = ip; ip += mbs;
  f->item_next = ip; ip += n;
  f->item_prev = ip; ip += n;
  f->item_mb = ip; ip += n;
  f->item_bin = ip; ip += n;
  int *filled = ip;  /* bins placed so far per class */
  for (Py_ssize_t k = 0; k < mbs; k++) f->free_mb[k] = (int)(mbs - 1 - k);  /* pops 0, 1, 2, ... */
  f->free_top = (int)mbs;
  for (Py_ssize_t i = 0; i < n; i++) f->item_bin[i] = f->item_mb[i] = -1;
  const int64_t *order = I64(a[0]);
  for (Py_ssize_t k = 0; k < count; k++)
    if (order[k] < 0 || order[k] >= n) {
      PyErr_SetString(PyExc_ValueError, "fill: an item out of range");
      return -1;
    }
  for (Py_ssize_t b = 0; b < nb; b++) {
    if (f->bin_class[b] < 0 || f->bin_class[b] >= nc) {
      PyErr_SetString(PyExc_ValueError, "fill: a bin of no class");
      return -1;
    }
    f->finish[b] = F64(a[10])[b];
    f->first_mb[b] = f->last_mb[b] = -1;
    f->class_count[f->bin_class[b]]++;
  }
  for (Py_ssize_t c = 1; c < nc; c++) f->class_start[c] = f->class_start[c - 1] + f->class_count[c - 1];
  for (Py_ssize_t b = 0; b < nb; b++) {  /* each class in [B1]'s order, by insertion */
    int c = (int)f->bin_class[b], *list = f->sorted + f->class_start[c], pos = filled[c]++;
    while (pos > 0 && before(f, (int)b, list[pos - 1])) {
      list[pos] = list[pos - 1];
      pos--;
    }
    list[pos] = (int)b;
  }
  return 0;
}

/* Each selected bin's (microbatches, rooms, finish), or for all bins where `selected` is NULL. */
static PyObject *bins_out(const Fill *f, const char *selected, int with_index) {
  PyObject *result = PyList_New(0);
  for (Py_ssize_t b = 0; result != NULL && b < f->num_bins; b++) {
    if (selected != NULL && !selected[b]) continue;
    PyObject *mbl = PyList_New(0), *rooms = PyList_New(0), *entry = NULL;
    int ok = mbl != NULL && rooms != NULL;
    for (int k = f->first_mb[b]; ok && k >= 0; k = f->mb_next[k]) {
      PyObject *items = PyList_New(0), *room = PyLong_FromLongLong(f->mb_room[k]);
      ok = items != NULL && room != NULL && PyList_Append(rooms, room) == 0;
      for (int i = f->mb_head[k]; ok && i >= 0; i = f->item_next[i]) {
        PyObject *v = PyLong_FromLong(i);
        ok = v != NULL && PyList_Append(items, v) == 0;
        Py_XDECREF(v);
      }
      ok = ok && PyList_Append(mbl, items) == 0;
      Py_XDECREF(items);
      Py_XDECREF(room);
    }
    if (ok)
      entry = with_index ? Py_BuildValue("(nOOd)", b, mbl, rooms, f->finish[b]) : Py_BuildValue("(OOd)", mbl, rooms, f->finish[b]);
    Py_XDECREF(mbl);
    Py_XDECREF(rooms);
    if (entry == NULL || PyList_Append(result, entry) < 0) Py_CLEAR(result);
    Py_XDECREF(entry);
  }
  return result;
}

/* lpt_fill(<the fill arrays>, floor_s, max_moves, scan) -> [(microbatches, rooms, finish) per bin]:
 * `fill.fill`, the items in `order` (longest first) each where it finishes earliest, then `improve`. */
static PyObject *lpt_fill(PyObject *self, PyObject *args) {
  PyObject *o[FILL_ARRAYS];
  double floor_s;
  long max_moves;
  int scan;
  (void)self;
  if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOdli", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                        &o[9], &o[10], &o[11], &floor_s, &max_moves, &scan))
    return NULL;
  Array a[FILL_ARRAYS];
  memset(a, 0, sizeof a);
  Fill f;
  void *memory = NULL;
  int *ascending = NULL;
  PyObject *result = NULL;
  if (fill_setup(&f, a, o, &memory) < 0) goto done;
  if (scan < 1) {
    PyErr_SetString(PyExc_ValueError, "lpt_fill: scan must be >= 1");
    goto done;
  }
  f.scan = scan;
  Py_ssize_t count = a[0].len;
  if ((ascending = malloc(sizeof(int) * (size_t)(count + 1))) == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  const int64_t *order = I64(a[0]);
  for (Py_ssize_t k = 0; k < count; k++) {
    int item = (int)order[k];
    if (f.item_bin[item] >= 0) {
      PyErr_SetString(PyExc_ValueError, "lpt_fill: an item twice");
      goto done;
    }
    double at;
    int b = best_bin(&f, item, -1, &at);
    if (b < 0) {
      PyErr_Format(PyExc_AssertionError, "no bin can hold sample index %d", item);
      goto done;
    }
    add(&f, item, b);
    ascending[k] = item;
  }
  qsort(ascending, (size_t)count, sizeof(int), cmp_int);
  improve(&f, ascending, count, floor_s, max_moves);
  result = bins_out(&f, NULL, 0);
done:
  free(memory);
  free(ascending);
  release(a, FILL_ARRAYS);
  return result;
}

/* hole_fill(<the fill arrays>, lengths) -> ([(bin, microbatches, rooms, finish) per used bin], rest):
 * `layout.fill_holes`, the bins one-rank holes of `lengths` seconds (one class), filled as [H2] states. */
static PyObject *hole_fill(PyObject *self, PyObject *args) {
  PyObject *o[FILL_ARRAYS + 1];
  (void)self;
  if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                        &o[9], &o[10], &o[11], &o[12]))
    return NULL;
  Array a[FILL_ARRAYS + 1];
  memset(a, 0, sizeof a);
  Fill f;
  void *memory = NULL;
  double *left = NULL;
  int *hole = NULL;
  char *used = NULL;
  PyObject *result = NULL, *rest = NULL, *groups = NULL;
  if (fill_setup(&f, a, o, &memory) < 0 || array_of(o[12], &a[12], 'd', "lengths") < 0) goto done;
  Py_ssize_t nb = f.num_bins, count = a[0].len;
  if (a[12].len != nb || f.num_classes != 1) {
    PyErr_SetString(PyExc_ValueError, "hole_fill: one class, and a length per hole");
    goto done;
  }
  left = malloc(sizeof(double) * (size_t)(nb + 1));
  hole = malloc(sizeof(int) * (size_t)(nb + 1));
  used = calloc((size_t)nb + 1, 1);
  rest = PyList_New(0);
  if (left == NULL || hole == NULL || used == NULL || rest == NULL) {
    if (rest != NULL) PyErr_NoMemory();
    goto done;
  }
  /* [H2]: (length, hole) sorted, as Python's sorted() of the pairs */
  for (Py_ssize_t k = 0; k < nb; k++) {
    double v = F64(a[12])[k];
    Py_ssize_t pos = k;
    while (pos > 0 && (left[pos - 1] > v || (left[pos - 1] == v && hole[pos - 1] > k))) {
      left[pos] = left[pos - 1];
      hole[pos] = hole[pos - 1];
      pos--;
    }
    left[pos] = v;
    hole[pos] = (int)k;
  }
  Py_ssize_t size = nb;
  const int64_t *order = I64(a[0]);
  double m = f.class_overhead[0];
  for (Py_ssize_t k = 0; k < count; k++) {
    int item = (int)order[k];
    double t = time_of(&f, 0, item) + m;
    Py_ssize_t lo = 0, hi = size;  /* bisect_left for (t, -1): the first length >= t */
    while (lo < hi) {
      Py_ssize_t mid = (lo + hi) / 2;
      if (left[mid] < t) lo = mid + 1; else hi = mid;
    }
    if (f.min_degree[item] > 1 || lo == size) {
      PyObject *v = PyLong_FromLong(item);
      int ok = v != NULL && PyList_Append(rest, v) == 0;
      Py_XDECREF(v);
      if (!ok) goto done;
      continue;
    }
    double room = left[lo];
    int h = hole[lo];
    memmove(left + lo, left + lo + 1, sizeof(double) * (size_t)(size - lo - 1));
    memmove(hole + lo, hole + lo + 1, sizeof(int) * (size_t)(size - lo - 1));
    size--;
    double before_s = f.finish[h];
    add(&f, item, h);
    used[h] = 1;
    double v = room - (f.finish[h] - before_s);
    Py_ssize_t pos = 0, top = size;  /* insort_right of (v, h) */
    while (pos < top) {
      Py_ssize_t mid = (pos + top) / 2;
      if (v < left[mid] || (v == left[mid] && h < hole[mid])) top = mid; else pos = mid + 1;
    }
    memmove(left + pos + 1, left + pos, sizeof(double) * (size_t)(size - pos));
    memmove(hole + pos + 1, hole + pos, sizeof(int) * (size_t)(size - pos));
    left[pos] = v;
    hole[pos] = h;
    size++;
  }
  if ((groups = bins_out(&f, used, 1)) != NULL) result = Py_BuildValue("(OO)", groups, rest);
done:
  Py_XDECREF(groups);
  Py_XDECREF(rest);
  free(memory);
  free(left);
  free(hole);
  free(used);
  release(a, FILL_ARRAYS + 1);
  return result;
}

/* ---- list schedules of wide samples on the ranks free first --------------------------------------- */

/* list_ends(orders, degree, t_in, t_out, overhead, num_ranks, gpus_per_node, spare[, placed]) -> (ends, critical, levels)
 *
 * `orders` is K rows of W local indices (flat, row-major) into the per-sample arrays; each row is one list
 * schedule from all ranks free at 0 ([L1], [L2]); `ends` its last finish and `critical` the place in the row of
 * the sample that ends it ([L3]), and the level that `spare` seconds of one-rank work fill the waits and the
 * ranks' ends up to ([L4]). The ranks are kept sorted by (ready, rank) between samples: a sample moves
 * only its own ranks, all to one time, so one merge keeps the order. With a list `placed`, each sample of each
 * row appends (its ranks in increasing order, begin, finish) to it (`scatter.place_scattered` asks one row). */
static PyObject *list_ends(PyObject *self, PyObject *args) {
  PyObject *o[5], *placed = Py_None;
  Py_ssize_t n, gpn;
  double spare;
  (void)self;
  if (!PyArg_ParseTuple(args, "OOOOOnnd|O", &o[0], &o[1], &o[2], &o[3], &o[4], &n, &gpn, &spare, &placed)) return NULL;
  if (placed != Py_None && !PyList_Check(placed)) {
    PyErr_SetString(PyExc_TypeError, "list_ends: placed must be a list or None");
    return NULL;
  }
  Array a[5];
  memset(a, 0, sizeof a);
  const char *names[5] = {"orders", "degree", "t_in", "t_out", "overhead"};
  for (int k = 0; k < 5; k++)
    if (array_of(o[k], &a[k], k < 2 ? 'q' : 'd', names[k]) < 0) {
      release(a, 5);
      return NULL;
    }
  PyObject *result = NULL, *ends = NULL, *critical = NULL, *levels = NULL;
  Py_ssize_t w = a[1].len;
  int64_t *idx = NULL, *count = NULL, *taken_ranks = NULL;
  double *ready = NULL, *sum = NULL, *start = NULL, *waste = NULL;
  char *mark = NULL;
  if (n < 1 || gpn < 1 || w < 1 || a[0].len % w || a[2].len != w || a[3].len != w || a[4].len != w) {
    PyErr_SetString(PyExc_ValueError, "list_ends: arrays of mismatched lengths");
    goto done;
  }
  const int64_t *orders = I64(a[0]), *degree = I64(a[1]);
  const double *t_in = F64(a[2]), *t_out = F64(a[3]), *over = F64(a[4]);
  for (Py_ssize_t k = 0; k < a[0].len; k++)
    if (orders[k] < 0 || orders[k] >= w || degree[orders[k]] < 1 || degree[orders[k]] > n) {
      PyErr_SetString(PyExc_ValueError, "list_ends: an order entry or degree out of range");
      goto done;
    }
  Py_ssize_t rows = a[0].len / w, nodes = (n + gpn - 1) / gpn;
  idx = malloc(sizeof(int64_t) * (size_t)n);
  count = malloc(sizeof(int64_t) * (size_t)nodes);
  taken_ranks = malloc(sizeof(int64_t) * (size_t)n);
  mark = malloc((size_t)n);
  ready = malloc(sizeof(double) * (size_t)n);
  sum = malloc(sizeof(double) * (size_t)nodes);
  start = malloc(sizeof(double) * (size_t)nodes);
  waste = malloc(sizeof(double) * (size_t)nodes);
  ends = PyList_New(rows);
  critical = PyList_New(rows);
  levels = PyList_New(rows);
  if (!levels || !idx || !count || !taken_ranks || !mark || !ready || !sum || !start || !waste || !ends || !critical) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t row = 0; row < rows; row++) {
    for (Py_ssize_t r = 0; r < n; r++) {
      ready[r] = 0.0;
      idx[r] = r;
    }
    double last = 0.0, waits = 0.0;
    Py_ssize_t crit = 0;
    for (Py_ssize_t step = 0; step < w; step++) {
      int64_t j = orders[row * w + step], d = degree[j];
      /* [L1]: the d first of (ready, rank) */
      double begin = ready[idx[d - 1]];
      int64_t lo = idx[0] / gpn, hi = lo;
      for (int64_t q = 1; q < d; q++) {
        int64_t node = idx[q] / gpn;
        lo = node < lo ? node : lo;
        hi = node > hi ? node : hi;
      }
      int spread = lo != hi;
      double finish = begin + (spread ? t_out[j] : t_in[j]) + over[j];
      int64_t take_node = -1;
      if (spread && d <= gpn) { /* [L2]: each node's d first, summed in that order */
        for (Py_ssize_t m = 0; m < nodes; m++) {
          count[m] = 0;
          sum[m] = 0.0;
          start[m] = INFINITY;
        }
        for (Py_ssize_t q = 0; q < n; q++) {
          int64_t r = idx[q], m = r / gpn;
          if (count[m] >= d) continue;
          sum[m] = count[m] ? sum[m] + ready[r] : ready[r];
          if (++count[m] == d) {
            start[m] = ready[r];
            waste[m] = (double)d * ready[r] - sum[m];
          }
        }
        int64_t best = -1;
        for (Py_ssize_t m = 0; m < nodes; m++)
          if (count[m] == d && (best < 0 || start[m] < start[best] || (start[m] == start[best] && waste[m] < waste[best])))
            best = m;
        if (best >= 0) {
          double end = start[best] + t_in[j] + over[j];
          if (end <= finish) {
            take_node = best;
            finish = end;
            begin = start[best];
          }
        }
      }
      for (Py_ssize_t r = 0; r < n; r++) mark[r] = 0;
      if (take_node < 0) {
        for (int64_t q = 0; q < d; q++) mark[idx[q]] = 1;
      } else {
        int64_t taken = 0;
        for (Py_ssize_t q = 0; q < n && taken < d; q++)
          if (idx[q] / gpn == take_node) {
            mark[idx[q]] = 1;
            taken++;
          }
      }
      /* back to (ready, rank) order: the others keep theirs; the taken ranks, by rank, all ready at `finish`,
       * merge in after the others that are ready earlier, or as early with a lower rank */
      Py_ssize_t kept = 0, moved = 0;
      for (Py_ssize_t q = 0; q < n; q++)
        if (!mark[idx[q]]) idx[kept++] = idx[q];
      double wait = 0.0;
      for (Py_ssize_t r = 0; r < n; r++)
        if (mark[r]) {
          wait = wait + (begin - ready[r]);
          ready[r] = finish;
          taken_ranks[moved++] = r;
        }
      waits = waits + wait;
      if (placed != Py_None) {
        PyObject *ranks = PyTuple_New(moved);
        if (ranks == NULL) goto done;
        for (Py_ssize_t m = 0; m < moved; m++) PyTuple_SET_ITEM(ranks, m, PyLong_FromLongLong(taken_ranks[m]));
        PyObject *entry = Py_BuildValue("(Ndd)", ranks, begin, finish);
        if (entry == NULL || PyList_Append(placed, entry) < 0) {
          Py_XDECREF(entry);
          goto done;
        }
        Py_DECREF(entry);
      }
      Py_ssize_t q = kept, t = moved;
      while (t > 0) { /* merge from the back into idx[0 .. kept + moved) */
        int64_t r = taken_ranks[t - 1];
        if (q > 0 && (ready[idx[q - 1]] > finish || (ready[idx[q - 1]] == finish && idx[q - 1] > r))) {
          idx[q + t - 1] = idx[q - 1];
          q--;
        } else {
          idx[q + t - 1] = r;
          t--;
        }
      }
      if (finish > last) { /* [L3] */
        last = finish;
        crit = step;
      }
    }
    PyList_SET_ITEM(ends, row, PyFloat_FromDouble(last));
    PyList_SET_ITEM(critical, row, PyLong_FromSsize_t(crit));
    double work = spare - waits, prefix = 0.0, level = 0.0; /* [L4]: idx holds the ranks by (ready, rank) */
    for (Py_ssize_t k = 0; k < n; k++) {
      prefix = k ? prefix + ready[idx[k]] : ready[idx[k]];
      level = (work + prefix) / (double)(k + 1);
      if (k + 1 == n || level <= ready[idx[k + 1]]) break;
    }
    PyList_SET_ITEM(levels, row, PyFloat_FromDouble(level));
  }
  result = PyTuple_Pack(3, ends, critical, levels);
done:
  Py_XDECREF(ends);
  Py_XDECREF(critical);
  Py_XDECREF(levels);
  free(idx);
  free(count);
  free(taken_ranks);
  free(mark);
  free(ready);
  free(sum);
  free(start);
  free(waste);
  release(a, 5);
  return result;
}

static PyMethodDef methods[] = {
    {"list_ends", list_ends, METH_VARARGS, "list schedules of wide samples: (ends, critical, levels) per order."},
    {"choose_window", choose_window, METH_VARARGS, "place_wide's window for one wide sample: (index, begin)."},
    {"lpt_fill", lpt_fill, METH_VARARGS, "fill's LPT and local moves: (microbatches, rooms, finish) per bin."},
    {"hole_fill", hole_fill, METH_VARARGS, "fill_holes: the used holes' (hole, microbatches, rooms, finish), the rest."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_draft",
    .m_doc = "dhp's draft loops, compiled (csrc/solver/draft.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__draft(void) { return PyModule_Create(&module); }
