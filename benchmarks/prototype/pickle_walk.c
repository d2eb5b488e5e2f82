/* A measured prototype, not shipped: the floor of a compiled .metadata reader. One pass over
   a DCP .metadata pickle (protocol 2-5, the opcodes torch's pickler writes there), each
   opcode's argument skipped and every int (BININT1/BININT2/BININT/LONG1 up to 8 bytes)
   copied into a column, as a compiled column reader would gather chunk boxes and storage
   offsets. Returns the number of opcodes, or -1 at an opcode it does not know or a cut file.
   benchmarks/metadata_floor.py compiles it with the system's C compiler and times it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

long long walk(const unsigned char *b, size_t size, int64_t *ints, size_t cap, size_t *nints) {
    size_t i = 0, k = 0;
    long long ops = 0;
    while (i < size) {
        unsigned char op = b[i++];
        size_t skip = 0;
        ops++;
        switch (op) {
        case 0x94: case 0x28: case 0x7d: case 0x5d: case 0x29: case 0x74: case 0x85:
        case 0x86: case 0x87: case 0x75: case 0x73: case 0x65: case 0x61: case 0x93:
        case 0x81: case 0x52: case 0x62: case 0x4e: case 0x88: case 0x89:
            break;
        case 0x2e: *nints = k; return ops;                        /* STOP */
        case 0x68: case 0x71: skip = 1; break;                    /* BINGET, BINPUT */
        case 0x6a: case 0x72: skip = 4; break;                    /* LONG_BINGET/PUT */
        case 0x80: skip = 1; break;                               /* PROTO */
        case 0x95: skip = 8; break;                               /* FRAME */
        case 0x47: skip = 8; break;                               /* BINFLOAT */
        case 0x8c: if (i >= size) return -1; skip = 1 + b[i]; break;
        case 0x58: if (i + 4 > size) return -1; skip = 4 + le(b + i, 4); break;
        case 0x8d: if (i + 8 > size) return -1; skip = 8 + le(b + i, 8); break;
        case 0x4b: case 0x4d: case 0x4a: {                        /* BININT1/2, BININT */
            int n = op == 0x4b ? 1 : op == 0x4d ? 2 : 4;
            if (i + n > size) return -1;
            int64_t v = (int64_t)le(b + i, n);
            if (n == 4) v = (int32_t)v;
            if (k < cap) ints[k++] = v;
            skip = n; break;
        }
        case 0x8a: {                                              /* LONG1 */
            if (i >= size) return -1;
            int n = b[i];
            if (n > 8 || i + 1 + n > size) return -1;
            if (k < cap) ints[k++] = (int64_t)le(b + i + 1, n);
            skip = 1 + n; break;
        }
        default: return -1;
        }
        if (skip > size - i) return -1;
        i += skip;
    }
    return -1;
}
