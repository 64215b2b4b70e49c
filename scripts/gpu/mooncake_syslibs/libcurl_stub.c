/*
 * libcurl.so.4 stand-in for mooncake's transfer engine on a machine that has no libcurl.
 *
 * mooncake-transfer-engine-cuda13 0.3.14's engine.so lists libcurl.so.4 as NEEDED for its HTTP
 * metadata plugin (a metadata server given as "http://..."). sglang 0.5.11 initialises the engine with
 * "P2PHANDSHAKE" metadata, which never uses it; the library only has to load. build_stage.sh --pd
 * compiles this file into the staged mooncake_syslibs/, and remote_env.sh puts it on
 * LD_LIBRARY_PATH only where the machine has no libcurl.so.4 of its own.
 *
 * Every function fails (CURLE_FAILED_INIT, NULL) and says on stderr, once, that it was called, so a
 * run that does reach HTTP shows it in its log instead of failing silently.
 */
#include <stddef.h>
#include <stdio.h>

#define CURLE_FAILED_INIT 2

static void called(const char *name) {
    static int said;
    if (!said) {
        said = 1;
        fprintf(stderr, "libcurl stub (staged for mooncake, see scripts/gpu/mooncake_syslibs): %s called; "
                        "no HTTP here\n", name);
    }
}

int curl_global_init(long flags) { (void)flags; called("curl_global_init"); return CURLE_FAILED_INIT; }
void *curl_easy_init(void) { called("curl_easy_init"); return NULL; }
void curl_easy_cleanup(void *h) { (void)h; }
void curl_easy_reset(void *h) { (void)h; }
int curl_easy_setopt(void *h, int option, ...) { (void)h; (void)option; called("curl_easy_setopt"); return CURLE_FAILED_INIT; }
int curl_easy_perform(void *h) { (void)h; called("curl_easy_perform"); return CURLE_FAILED_INIT; }
int curl_easy_getinfo(void *h, int info, ...) { (void)h; (void)info; called("curl_easy_getinfo"); return CURLE_FAILED_INIT; }
const char *curl_easy_strerror(int code) { (void)code; return "libcurl stub: no HTTP on this machine"; }
char *curl_easy_escape(void *h, const char *s, int n) { (void)h; (void)s; (void)n; called("curl_easy_escape"); return NULL; }
void curl_free(void *p) { (void)p; }
void *curl_slist_append(void *list, const char *s) { (void)list; (void)s; called("curl_slist_append"); return NULL; }
void curl_slist_free_all(void *list) { (void)list; }
